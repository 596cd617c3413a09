"""ModelMetadata from config.json: every architecture, rope key styles, token ids, errors."""
from __future__ import annotations

import dataclasses
import math

import pytest

from metrale import FormatError, Unsupported
from metrale.formats import (PRESETS, ModelMetadata, RopeScaling, expected_tensors,
                             num_parameters)

from .st_util import tiny_config


def meta(cfg, gen=None):
    return ModelMetadata.from_config(cfg, gen, source="/ckpt/config.json")


def test_tiny_preset_fields():
    m = meta(PRESETS["tiny"])
    assert (m.architecture, m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers,
            m.num_heads, m.num_kv_heads, m.head_dim) == ("llama", 512, 128, 344, 4, 4, 2, 32)
    assert (m.max_position_embeddings, m.rope_theta, m.rope_scaling) == (2048, 10000.0, None)
    assert (m.bos_token_id, m.eos_token_ids, m.tie_word_embeddings) == (1, (2,), False)
    assert m.dtype == "bfloat16" and not m.attention_bias and not m.qk_norm
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.vocab_size = 3
    with pytest.raises(TypeError):
        m.config["vocab_size"] = 3  # read-only view


def test_head_dim_explicit_or_derived():
    assert meta(tiny_config(head_dim=16)).head_dim == 16
    cfg = tiny_config()
    del cfg["head_dim"]
    assert meta(cfg).head_dim == 32 // 4
    cfg["hidden_size"] = 30
    with pytest.raises(FormatError, match="config.json.*not a multiple"):
        meta(cfg)


def test_kv_heads_default_and_divisibility():
    cfg = tiny_config()
    del cfg["num_key_value_heads"]
    assert meta(cfg).num_kv_heads == 4
    with pytest.raises(FormatError, match="num_key_value_heads 3"):
        meta(tiny_config(num_key_value_heads=3))


# -- rope: legacy rope_scaling + rope_theta, and rope_parameters --------------------------
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("style", ["legacy_rope_type", "legacy_type", "rope_parameters"])
def test_llama3_rope_in_every_key_style(style):
    cfg = tiny_config()
    cfg.pop("rope_scaling")
    cfg.pop("rope_theta")
    if style == "legacy_rope_type":
        cfg.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    elif style == "legacy_type":
        cfg.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})
    else:
        cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    m = meta(cfg)
    assert m.rope_theta == 500000.0
    assert m.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_rope_default_and_linear():
    m = meta(tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (m.rope_theta, m.rope_scaling) == (1e6, None)
    m = meta(tiny_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert m.rope_scaling == RopeScaling("linear", factor=2.0)
    assert m.rope_theta == 10000.0
    # transformers 5 takes a set rope_scaling over rope_parameters
    # (PreTrainedConfig.convert_rope_params_to_dict: `rope_scaling or rope_parameters`);
    # theta defaults to 10000 when absent
    cfg = tiny_config(rope_parameters={"rope_type": "linear", "factor": 3.0},
                      rope_scaling={"type": "linear", "factor": 9.0})
    cfg.pop("rope_theta")
    m = meta(cfg)
    assert (m.rope_theta, m.rope_scaling.factor) == (10000.0, 9.0)
    cfg["rope_scaling"] = None   # unset: rope_parameters
    assert meta(cfg).rope_scaling.factor == 3.0


def test_rope_yarn_defaults():
    m = meta(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 128}))
    rs = m.rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert (rs.beta_fast, rs.beta_slow, rs.attention_factor, rs.truncate) == (32.0, 1.0, None, True)
    assert rs.yarn_attention_factor() == pytest.approx(0.1 * math.log(4.0) + 1)
    m = meta(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "attention_factor": 1.5, "beta_fast": 16}))
    assert m.rope_scaling.original_max_position_embeddings == 2048  # max_position_embeddings
    assert m.rope_scaling.yarn_attention_factor() == 1.5 and m.rope_scaling.beta_fast == 16.0


@pytest.mark.parametrize("scaling, exc, msg", [
    ({"rope_type": "longrope", "factor": 2.0}, Unsupported, "rope type 'longrope'"),
    ({"rope_type": "llama3", "factor": 8.0}, FormatError, "low_freq_factor"),
    ({"type": "linear"}, FormatError, "factor"),
    ("linear", FormatError, "rope_scaling must be an object"),
])
def test_rope_errors(scaling, exc, msg):
    with pytest.raises(exc, match=f"/ckpt/config.json.*{msg}"):
        meta(tiny_config(rope_scaling=scaling))


def test_rope_theta_must_be_positive():
    with pytest.raises(FormatError, match="rope_theta"):
        meta(tiny_config(rope_theta=0))


# -- token ids ----------------------------------------------------------------------------
def test_eos_list_and_generation_config_precedence():
    assert meta(tiny_config(eos_token_id=[2, 7])).eos_token_ids == (2, 7)
    m = meta(tiny_config(eos_token_id=2, bos_token_id=1),
             {"eos_token_id": [9, 10], "bos_token_id": 5})
    assert (m.bos_token_id, m.eos_token_ids) == (5, (9, 10))
    # a generation_config without the keys leaves config.json's
    m = meta(tiny_config(eos_token_id=[2, 3]), {"max_length": 20})
    assert m.eos_token_ids == (2, 3)
    assert meta(tiny_config(eos_token_id=None, bos_token_id=None)).eos_token_ids == ()
    with pytest.raises(FormatError, match="eos_token_id"):
        meta(tiny_config(eos_token_id="x"))


def test_dtype_keys():
    cfg = tiny_config()
    cfg.pop("torch_dtype")
    assert meta(cfg).dtype == "float32"  # HF's default
    assert meta({**cfg, "dtype": "float16"}).dtype == "float16"
    assert meta({**cfg, "torch_dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(Unsupported, match="int8"):
        meta({**cfg, "torch_dtype": "int8"})


# -- per-architecture switches ------------------------------------------------------------
def test_qwen2_bias_and_sliding_window():
    m = meta(tiny_config(model_type="qwen2", sliding_window=4096, use_sliding_window=False))
    assert m.attention_bias and not m.qk_norm and m.sliding_window is None
    # HF's legacy rule: layers i >= max_window_layers (absent: 28) slide
    m = meta(tiny_config(model_type="qwen2", sliding_window=4096, use_sliding_window=True))
    assert m.sliding_window is None and not any(m.layer_windows)
    m = meta(tiny_config(model_type="qwen2", sliding_window=4096, use_sliding_window=True,
                         max_window_layers=1, num_hidden_layers=3))
    assert m.sliding_window == 4096 and m.layer_windows[0] == 0
    assert set(m.layer_windows[1:]) == {4096}
    t = expected_tensors(m)
    assert "model.layers.0.self_attn.k_proj.bias" in t
    assert "model.layers.0.self_attn.o_proj.bias" not in t   # qwen2: never an o_proj bias


def test_qwen3_qk_norm_and_mistral_window():
    m = meta(tiny_config(model_type="qwen3"))
    assert m.qk_norm and not m.attention_bias
    assert expected_tensors(m)["model.layers.0.self_attn.q_norm.weight"] == (8,)
    assert meta(tiny_config(model_type="mistral", sliding_window=4096)).sliding_window == 4096
    assert meta(tiny_config(model_type="mistral", sliding_window=None)).sliding_window is None


def test_llama_attention_bias_and_tied():
    m = meta(tiny_config(attention_bias=True, tie_word_embeddings=True))
    t = expected_tensors(m)
    assert m.attention_bias and t["model.layers.0.self_attn.q_proj.bias"] == (32,)
    assert "lm_head.weight" not in t
    assert "lm_head.weight" in expected_tensors(meta(tiny_config()))
    assert t["model.layers.0.self_attn.o_proj.bias"] == (32,)   # HF: o_proj too
    m = meta(tiny_config(mlp_bias=True))
    t = expected_tensors(m)
    assert m.mlp_bias and t["model.layers.0.mlp.up_proj.bias"] == (m.intermediate_size,)
    assert t["model.layers.0.mlp.down_proj.bias"] == (32,)


def test_missing_and_bad_keys():
    cfg = tiny_config()
    del cfg["hidden_size"]
    with pytest.raises(FormatError, match=r"/ckpt/config.json: missing key 'hidden_size'"):
        meta(cfg)
    with pytest.raises(FormatError, match="missing key 'model_type'"):
        meta({"hidden_size": 3})
    with pytest.raises(FormatError, match="vocab_size must be a positive integer"):
        meta(tiny_config(vocab_size=-1))
    with pytest.raises(FormatError, match="tie_word_embeddings must be true or false"):
        meta(tiny_config(tie_word_embeddings="yes"))


def test_unsupported_model_type():
    with pytest.raises(Unsupported, match=r"/ckpt/config.json: model_type 'gpt2'"):
        meta(tiny_config(model_type="gpt2"))


# -- whisper and llava --------------------------------------------------------------------
def test_whisper_small_preset():
    from metrale.formats.presets import preset_config
    cfg, gen = preset_config("whisper-small")
    m = meta(cfg, gen)
    w = m.whisper
    assert m.architecture == "whisper" and m.hidden_size == 768 and m.vocab_size == 51865
    assert (w.encoder_layers, w.decoder_layers, w.num_mel_bins, w.num_mel_frames) == \
        (12, 12, 80, 3000)
    assert w.decoder_start_token_id == 50258 and w.no_timestamps_token_id == 50363
    assert w.task_to_id["transcribe"] == 50359 and w.lang_to_id["<|en|>"] == 50259
    assert w.forced_decoder_ids == ((1, None), (2, 50359))
    assert m.eos_token_ids == (50257,)
    assert 240e6 < num_parameters(m) < 245e6  # whisper-small: 242M


def test_llava_config():
    cfg = {
        "model_type": "llava", "image_token_index": 60, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
        "text_config": tiny_config(),
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16,
                          "intermediate_size": 32, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
    }
    m = meta(cfg)
    assert m.architecture == "llava" and m.text.architecture == "llama"
    assert m.vocab_size == 64 and m.vision.num_patches == 16 and m.vision.num_image_tokens == 16
    t = expected_tensors(m)
    assert t["multi_modal_projector.linear_1.weight"] == (32, 16)
    assert t["vision_tower.vision_model.embeddings.position_embedding.weight"] == (17, 16)
    assert "language_model.lm_head.weight" in t
    with pytest.raises(FormatError, match="image_token_index 99"):
        meta({**cfg, "image_token_index": 99})
    with pytest.raises(FormatError, match="text_config"):
        meta({"model_type": "llava"})


@pytest.mark.parametrize("name, billions", [("llama-3.1-8b", 8.03), ("qwen2.5-7b", 7.62),
                                            ("qwen2.5-0.5b", 0.494),
                                            ("qwen3-8b", 8.19), ("mistral-7b", 7.25),
                                            ("llama-3.1-70b", 70.55)])
def test_real_preset_parameter_counts(name, billions):
    assert num_parameters(meta(PRESETS[name])) / 1e9 == pytest.approx(billions, abs=0.01)


# -- HF's per-family defaults and precedence rules (transformers 5.24, field_table.py) ----
def _bare(model_type, **over):
    cfg = tiny_config(model_type=model_type, **over)
    for k in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        if k not in over:
            cfg.pop(k, None)
    return cfg


@pytest.mark.parametrize("arch, kv, max_pos, window", [
    ("llama", 4, 2048, None), ("mistral", 8, 131072, 4096), ("qwen2", 32, 32768, None),
    ("qwen3", 32, 32768, None)])
def test_absent_keys_take_the_family_defaults(arch, kv, max_pos, window):
    cfg = _bare(arch, num_attention_heads=32 if arch != "llama" else 4,
                hidden_size=256 if arch != "llama" else 32)
    m = meta(cfg)
    assert (m.num_kv_heads, m.max_position_embeddings, m.sliding_window) == (kv, max_pos, window)
    assert m.head_dim == (128 if arch == "qwen3" else m.hidden_size // m.num_heads)
    assert meta({**cfg, "num_key_value_heads": None}).num_kv_heads == m.num_heads  # null
    assert meta({**cfg, "sliding_window": None}).sliding_window is None


def test_rope_precedence_rules():
    # top-level original_max_position_embeddings overrides the dict's (llama3 / yarn)
    m = meta(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 100},
                         original_max_position_embeddings=77))
    assert m.rope_scaling.original_max_position_embeddings == 77
    # yarn factor null: max_position_embeddings / original
    m = meta(tiny_config(max_position_embeddings=1024,
                         rope_scaling={"rope_type": "yarn", "factor": None,
                                       "original_max_position_embeddings": 256}))
    assert m.rope_scaling.factor == 4.0 and m.context_length == 1024
    # the dict's rope_theta wins over the top-level one
    m = meta(tiny_config(rope_theta=5.0, rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 7.0}))
    assert m.rope_theta == 7.0
    # partial_rotary_factor: ignored by the default rope (as HF), refused when it shortens
    assert meta(tiny_config(partial_rotary_factor=0.5)).rope_scaling is None
    with pytest.raises(Unsupported, match="partial_rotary_factor=0.5"):
        meta(tiny_config(partial_rotary_factor=0.5,
                         rope_scaling={"rope_type": "linear", "factor": 2.0}))
    # dynamic: the default rope up to max_position_embeddings, which is the context
    m = meta(tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert m.rope_scaling.original_max_position_embeddings == m.context_length == 2048


def test_dtype_key_wins_over_torch_dtype_and_unknown_quantization_is_refused():
    assert meta(tiny_config(dtype="float16", torch_dtype="bfloat16")).dtype == "float16"
    with pytest.raises(Unsupported, match="quantization_config.quant_method = 'hqq'"):
        meta(tiny_config(quantization_config={"quant_method": "hqq"}))
    with pytest.raises(Unsupported, match="quantization_config.version = 'gemv'"):
        meta(tiny_config(quantization_config={"quant_method": "awq", "version": "gemv"}))


def test_activation_names():
    for name in ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                 "relu", "quick_gelu"):
        assert meta(tiny_config(hidden_act=name)).hidden_act == name
    with pytest.raises(Unsupported, match="hidden_act='mish'"):
        meta(tiny_config(hidden_act="mish"))


def test_qwen3_layer_types_win_over_max_window_layers():
    m = meta(tiny_config(model_type="qwen3", num_hidden_layers=3, use_sliding_window=True,
                         sliding_window=7, max_window_layers=0,
                         layer_types=["full_attention", "sliding_attention", "attention"]))
    assert m.layer_windows == (0, 7, 0)
    with pytest.raises(FormatError, match="one type per layer"):
        meta(tiny_config(model_type="qwen3", layer_types=["full_attention"] * 2))


def test_llava_top_level_tie_ties_the_text_model():
    import json

    from tests.model.common import FIXTURES
    cfg = json.loads((FIXTURES / "llava_tiny" / "config.json").read_text())
    assert not meta(cfg).text.tie_word_embeddings
    m = meta({**cfg, "tie_word_embeddings": True})   # LlavaConfig: top level OR text model
    assert m.tie_word_embeddings and m.text.tie_word_embeddings
