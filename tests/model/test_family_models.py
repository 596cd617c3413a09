"""Issue 40's families beyond the shared golden suite (test_golden.py, test_gpu_model.py and
tests/generative/test_tensor_api.py run these fixtures through every forward path on cpu and
emu): each feature of a family, neutralised, moves the logits well past the golden
tolerance (so the fixtures test what they claim); speculative decoding equals greedy; the
tensor API on the kernels; what is refused, by name, before anything is uploaded."""
import json
import math
import shutil
from dataclasses import replace

import numpy as np
import pytest

import metrale
from metrale import CacheConfig, UnsupportedMedia
from metrale.engine import generate, speculative_generate
from metrale.errors import FormatError, Unsupported
from metrale.formats.gemma_config import embed_scale
from metrale.formats.metadata import ModelMetadata
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend
from metrale.gpu_runtime.types import NULL
from metrale.ops import rope
from tests.formats.st_util import tensors_bytes
from tests.model.common import (FAMILY_FIXTURES, FIXTURES, assert_matches_golden, golden, load,
                                logits_rows, rel_err)


def teacher_forced(m, ids, prefix=6):
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:prefix], seq, s))[0]]
    rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in ids[prefix:]]
    m.free_sequence(seq)
    return np.stack(rows)


def _variant(m, **changes):
    m._meta = m._layer_meta = replace(m._meta, variant=replace(m._meta.variant, **changes))


def _neutralise(m, feature):
    """The model as it would be with `feature` ignored (the bug each fixture must catch)."""
    var = m._meta.variant
    if feature == "windows":
        m._meta = m._layer_meta = replace(m._meta, layer_windows=(0,) * m._meta.num_layers)
    elif feature == "norm (1 + w)":
        _variant(m, norm_mode="llama")
    elif feature == "sandwich norms":
        _variant(m, sandwich_norms=False)
    elif feature == "query_pre_attn_scalar":
        m._attn_scale = 1.0 / math.sqrt(m._meta.head_dim)
    elif feature == "local rope":   # every layer on the full layers' table
        full = m._layer_rope[m._meta.layer_windows.index(0)]
        m._layer_rope = [full] * len(m._layer_rope)
    elif feature in ("sinks", "router bias", "gate_up bias", "down bias", "attention biases"):
        for L in m._weights.layers:
            if feature == "sinks":
                L.sinks = NULL
            elif feature == "attention biases":
                L.qkv_bias = L.o_bias = NULL
            else:
                setattr(L.moe, feature.replace(" ", "_"), NULL)
    elif feature in ("swiglu limit", "swiglu alpha"):
        moe = m._meta.moe
        oss = replace(moe.oss, **({"swiglu_limit": 1e30} if feature == "swiglu limit"
                                  else {"swiglu_alpha": 1.0}))
        m._meta = m._layer_meta = replace(m._meta, moe=replace(moe, oss=oss))
    elif feature == "partial rotary":   # the whole head rotated
        meta = m._meta
        table = rope.rope_table(meta.head_dim, m._max_positions, meta.rope_theta, None)
        m._layer_rope = [m.backend.alloc(table.nbytes)] * meta.num_layers
        m.backend.copy_h2d(table, m._layer_rope[0])
        _variant(m, rotary_dim=0)
    else:
        _variant(m, **{feature: type(getattr(var, feature))()})


GEMMA = ["windows", "norm (1 + w)", "sandwich norms", "query_pre_attn_scalar", "embed_scale"]
FEATURES = {
    "gemma2": GEMMA + ["attn_softcap", "final_softcap"],
    "gemma3_text": GEMMA + ["final_softcap", "local rope"],
    "gemma3": GEMMA + ["local rope"],
    "phi3": ["windows", "partial rotary"],
    "gpt_oss": ["windows", "sinks", "router bias", "gate_up bias", "down bias",
                "attention biases", "swiglu limit", "swiglu alpha"],
}


@pytest.mark.parametrize("name,feature", [(n, f) for n, fs in FEATURES.items() for f in fs])
def test_each_feature_moves_the_logits_past_the_tolerance(name, feature):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(name)
    assert rel_err(teacher_forced(m, ids), g["logits"][5:]) < 0.03
    _neutralise(m, feature)
    err = rel_err(teacher_forced(m, ids), g["logits"][5:])
    assert err > 0.06, f"{name}: ignoring {feature} moves the logits by only {err:.3f}"


def test_gemma3_checkpoint_never_soft_caps_its_logits():
    """Gemma3ForConditionalGeneration does not apply final_logit_softcapping (its text
    config sets 1.5 here); the golden was made by that class."""
    assert json.loads((FIXTURES / "gemma3" / "config.json").read_text())[
        "text_config"]["final_logit_softcapping"]
    m = load("gemma3")
    assert m.metadata().variant.final_softcap == 0.0
    g = golden("gemma3")
    _variant(m, final_softcap=1.5)
    assert rel_err(teacher_forced(m, g["input_ids"][0].tolist()), g["logits"][5:]) > 0.06


def test_embedding_scale_is_rounded_as_hf_casts_its_normalizer():
    """sqrt(hidden) as a float32 tensor cast to BF16 (the weights' dtype), then multiplied."""
    assert embed_scale(2304) == 48.0                 # Gemma 2 2B: exact
    assert embed_scale(640) == 25.25                 # Gemma 3 270M: 25.298... rounds
    assert embed_scale(1152) == 34.0                 # Gemma 3 1B: 33.94... rounds
    assert embed_scale(48) == 6.9375                 # the fixtures' width
    assert load("gemma2").metadata().variant.embed_scale == 6.9375


def test_gemma_defaults_fill_a_sparse_text_config():
    """A gemma3 checkpoint's text_config holds only what differs from the class defaults
    (Gemma 3 4B's: hidden, intermediate, layers, window, rope scaling)."""
    m = ModelMetadata.from_config({
        "model_type": "gemma3", "text_config": {
            "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert (m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim) == (262208, 8, 4, 256)
    assert m.layer_windows.count(0) == 5 and m.layer_windows[5] == 0
    assert m.rope_theta == 1e6 and m.rope_scaling.factor == 8.0
    assert m.variant.local_rope == (10000.0, None) and m.tie_word_embeddings
    assert m.variant.attn_scale == 256 ** -0.5 and m.variant.final_softcap == 0.0


@pytest.mark.parametrize("name", FAMILY_FIXTURES + ["phi3_longrope"])
def test_speculative_equals_greedy(name):
    target = load(name)
    prompt = golden(name)["input_ids"][0, :7].tolist()
    want = generate(target, prompt, 16, stop_token_ids=[]).tokens
    for draft in (load("qwen3"), load(name)):   # vocabularies of 256 tokens
        for k in (1, 4):
            r = speculative_generate(target, draft, prompt, 16, k=k, stop_token_ids=[])
            assert r.tokens == want, (name, k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_device_tensor_api_matches_hf(device, name, kind):
    g = golden(name)
    ids = g["input_ids"]
    gm = metrale.load_generative(FIXTURES / name, device, progress=False)
    with gm.create_kv_cache(CacheConfig(kind=kind, max_seq_len=32)) as cache:
        rows = [to_numpy(gm.prefill(gm.embed(ids[:, :10]), cache, range(0, 10)))[0]]
        rows += [to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0]
                 for t in range(10, 24)]
    assert_matches_golden(np.stack(rows[:-1]), g["logits"][9:23], f"{name} {kind}")


def test_gemma3_loads_its_text_model_only(tmp_path):
    """The vision tower is held by the checkpoint but not uploaded (weights: the text
    model's bytes), images are refused, and any other stray tensor still is."""
    m = load("gemma3")
    text = load("gemma3_text")
    assert m.weight_bytes() == text.weight_bytes() - 256 * 48 * 2   # gemma3_text: untied
    gm = metrale.load_generative(FIXTURES / "gemma3", HostBackend(), progress=False)
    with pytest.raises(UnsupportedMedia):
        gm.embed_multimodal(np.array([[1, 255, 2]]), [np.zeros((1, 3, 16, 16), np.float32)])
    d = tmp_path / "gemma3"
    shutil.copytree(FIXTURES / "gemma3", d)
    (d / "model.safetensors").rename(d / "a.safetensors")   # two files, both read
    (d / "b.safetensors").write_bytes(tensors_bytes(
        {"model.stray.weight": ("F32", np.zeros(4, np.float32))}))
    with pytest.raises(FormatError, match="model.stray.weight"):
        metrale.load(d, HostBackend(), progress=False)


def _cfg(name, **changes):
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    inner = cfg["text_config"] if name == "gemma3" else cfg
    for k, v in changes.items():
        if v is KeyError:
            inner.pop(k, None)
        else:
            inner[k] = v
    return cfg


@pytest.mark.parametrize("name,changes,err,match", [
    ("gemma2", dict(use_bidirectional_attention=True), Unsupported, "use_bidirectional"),
    ("gemma3_text", dict(use_bidirectional_attention=True), Unsupported,
     "use_bidirectional"),
    ("gemma2", dict(sliding_window=None), Unsupported, "sliding_window is null"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention", "full_attention",
                                 "full_attention"]), Unsupported, "chunked_attention"),
    ("gemma3_text", dict(layer_types=["full_attention"]), FormatError, "layer_types"),
    ("gemma3_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     Unsupported, "per-layer-type"),
    ("gemma2", dict(head_dim=None), FormatError, "head_dim is null"),
    ("gemma2", dict(num_key_value_heads=None), FormatError, "num_key_value_heads is null"),
    ("gemma2", dict(final_logit_softcapping=-1.0), FormatError, "final_logit_softcapping"),
    ("gemma2", dict(attn_logit_softcapping=float("nan")), FormatError,
     "attn_logit_softcapping"),
    ("gemma2", dict(query_pre_attn_scalar=0), FormatError, "query_pre_attn_scalar"),
    ("gemma2", dict(hidden_activation="gelu_accurate"), Unsupported, "hidden_activation"),
    ("gemma2", dict(quantization_config={"quant_method": "fp8"}), Unsupported,
     "quantization_config"),
    ("gemma3", dict(model_type="gemma2"), Unsupported, "gemma3 text model"),
])
def test_bad_configs_are_refused_by_name(name, changes, err, match):
    with pytest.raises(err, match=match):
        ModelMetadata.from_config(_cfg(name, **changes), source="config.json")


def test_hidden_act_and_attn_softcap_of_gemma3_change_nothing():
    """Fields HF's Gemma 3 stores but never reads: the same model either way."""
    base = ModelMetadata.from_config(_cfg("gemma3_text"))
    other = ModelMetadata.from_config(_cfg("gemma3_text", hidden_act="relu",
                                           attn_logit_softcapping=3.0))
    assert other.variant == base.variant and other.hidden_act == base.hidden_act


@pytest.mark.parametrize("config,named", [
    ({"model_type": "gemma4_text"},   # the class defaults: Gemma 4 E2B-like
     ["v_norm", "layer_scalar", "hidden_size_per_layer_input=256", "global_head_dim=512",
      "'proportional'"]),
    ({"model_type": "gemma4", "text_config": {
        "hidden_size_per_layer_input": 0, "global_head_dim": 256, "num_kv_shared_layers": 4,
        "attention_k_eq_v": True, "use_double_wide_mlp": True, "enable_moe_block": True,
        "use_bidirectional_attention": "vision",
        "rope_parameters": {"full_attention": {"rope_type": "default"}}}},
     ["v_norm", "layer_scalar", "num_kv_shared_layers=4", "attention_k_eq_v=True",
      "use_double_wide_mlp=True", "enable_moe_block=True",
      "use_bidirectional_attention='vision'"]),
])
def test_gemma4_is_refused_naming_every_piece_it_lacks(config, named):
    with pytest.raises(Unsupported, match="Gemma 4") as e:
        ModelMetadata.from_config(config, source="config.json")
    for piece in named:
        assert piece in str(e.value), piece
    if "text_config" in config:   # what is neutral is not named
        assert "hidden_size_per_layer_input" not in str(e.value)
        assert "global_head_dim" not in str(e.value)
