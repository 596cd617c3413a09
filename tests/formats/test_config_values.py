"""Every numeric config value is checked at load (issue 29 §2): finite, and in the range the
formula that reads it needs. A bad value raises FormatError / Unsupported naming the file,
the field and the value, before any weight is read (the fixture's weights are linked, not
copied), never a bare Python exception, a NaN table or NaN logits later."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

import metrale
from metrale import FormatError, Unsupported
from metrale.gpu_runtime import HostBackend
from tests.model.common import FIXTURES

NAN, INF = float("nan"), float("inf")


def _config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


def _set(**kv):
    return lambda cfg: cfg.update(kv)


def _rope(**params):
    """Replace the fixture's rope with rope_parameters `params` (rope_scaling cleared)."""
    def edit(cfg):
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {"rope_theta": 10000.0, **params}
    return edit


def _vision(**kv):
    return lambda cfg: cfg["vision_config"].update(kv)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)

CASES = [
    # (fixture, edit, error class, what the message must name: field and value)
    ("llama_gqa", _set(rms_norm_eps=-1e-6), FormatError, "rms_norm_eps must be >= 0, got -1e-06"),
    ("llama_gqa", _set(rms_norm_eps=NAN), FormatError, "rms_norm_eps must be a finite number, got nan"),
    ("llama_gqa", _set(rms_norm_eps=INF), FormatError, "rms_norm_eps must be a finite number, got inf"),
    ("llama_gqa", _set(rms_norm_eps=1e300), FormatError, "rms_norm_eps 1e\\+300 does not fit a float32"),
    ("llama_gqa", _set(rms_norm_eps="1e-6"), FormatError, "rms_norm_eps must be a number, got '1e-6'"),
    ("llama_gqa", _set(rope_theta=INF), FormatError, "rope_theta must be a finite number, got inf"),
    ("llama_gqa", _set(rope_theta=0), FormatError, "rope_theta must be > 0, got 0"),
    ("llama_gqa", _set(rope_theta=-1e4), FormatError, "rope_theta must be > 0, got -10000.0"),
    ("mistral", _rope(rope_type="default", rope_theta=NAN), FormatError,
     r"\(rope_parameters\): rope_theta must be a finite number, got nan"),
    ("llama_gqa", _rope(rope_type="linear", factor=0), FormatError, "factor must be > 0, got 0"),
    ("llama_gqa", _rope(rope_type="linear", factor=NAN), FormatError, "factor must be a finite number, got nan"),
    ("llama_gqa", _rope(rope_type="dynamic", factor=-2.0), FormatError, "factor must be > 0, got -2.0"),
    ("llama_gqa", _rope(**{**LLAMA3, "factor": 0.0}), FormatError, "factor must be > 0, got 0.0"),
    ("llama_gqa", _rope(**{**LLAMA3, "low_freq_factor": 0}), FormatError,
     "low_freq_factor must be > 0, got 0"),
    ("llama_gqa", _rope(**{**LLAMA3, "high_freq_factor": 0}), FormatError,
     "high_freq_factor must be > 0, got 0"),
    ("llama_gqa", _rope(**{**LLAMA3, "high_freq_factor": NAN}), FormatError,
     "high_freq_factor must be a finite number, got nan"),
    ("llama_gqa", _rope(**{**LLAMA3, "high_freq_factor": 1.0}), FormatError,
     "low_freq_factor and high_freq_factor are both 1.0"),
    ("llama_gqa", _rope(**{**YARN, "factor": 0}), FormatError, "factor must be > 0, got 0"),
    ("llama_gqa", _rope(**{**YARN, "factor": INF}), FormatError, "factor must be a finite number, got inf"),
    ("llama_gqa", _rope(**{**YARN, "beta_fast": NAN}), FormatError,
     "beta_fast must be a finite number, got nan"),
    ("llama_gqa", _rope(**{**YARN, "beta_fast": -32}), FormatError, "beta_fast must be > 0, got -32"),
    ("llama_gqa", _rope(**{**YARN, "beta_slow": -1.0}), FormatError, "beta_slow must be > 0, got -1.0"),
    ("llama_gqa", _rope(**{**YARN, "attention_factor": 0.0}), FormatError,
     "attention_factor must be > 0, got 0.0"),
    ("llama_gqa", _rope(**{**YARN, "attention_factor": 1e300}), FormatError,
     "attention_factor 1e\\+300 does not fit a float32"),
    ("llama_gqa", _rope(**{**YARN, "mscale": NAN, "mscale_all_dim": 1.0}), FormatError,
     "mscale must be a finite number, got nan"),
    ("llama_gqa", _rope(**{**YARN, "factor": math.e ** 2, "mscale": 1.0, "mscale_all_dim": -5.0}),
     FormatError, "mscale=1.0 / mscale_all_dim=-5.0 give the attention factor"),
    ("llama_gqa", _rope(**{**YARN, "truncate": "yes"}), FormatError,
     "truncate must be true or false, got 'yes'"),
    ("llama_gqa", _rope(**{**YARN, "rope_theta": 1.0}), FormatError,
     "rope_theta 1 with rope type 'yarn'"),
    ("llama_gqa", _rope(**{**YARN, "partial_rotary_factor": NAN}), FormatError,
     "partial_rotary_factor must be a finite number, got nan"),
    ("llama_gqa", _rope(**{**YARN, "partial_rotary_factor": 1.5}), FormatError,
     "partial_rotary_factor must be in \\(0, 1\\], got 1.5"),
    ("llama_gqa", _set(head_dim=15), FormatError,
     "head_dim must be even for the rotary embedding, got 15"),
    ("llama_gqa", _set(head_dim=None, hidden_size=60, num_attention_heads=4), FormatError,
     "head_dim must be even for the rotary embedding, got 15 \\(hidden_size 60 / "
     "num_attention_heads 4\\)"),
    ("qwen3", _set(head_dim=512), Unsupported, "head_dim 512 is not supported"),
    ("whisper_tiny", _set(decoder_attention_heads=64), Unsupported,
     "d_model 64 / decoder_attention_heads 64 gives head_dim 1"),
    ("llava_tiny", _vision(layer_norm_eps=NAN), FormatError,
     r"\(vision_config\): layer_norm_eps must be a finite number, got nan"),
    ("llava_tiny", _vision(layer_norm_eps=-1e-5), FormatError,
     r"\(vision_config\): layer_norm_eps must be >= 0, got -1e-05"),
    ("llava_tiny", _vision(num_attention_heads=3), FormatError,
     "hidden_size 32 is not a multiple of num_attention_heads 3"),
    ("llava_tiny", _vision(patch_size=64), FormatError, "patch_size 64 is larger than image_size 32"),
    ("llava_tiny", _set(vision_feature_layer=3), FormatError,
     "vision_feature_layer 3 is outside the 3 hidden states of a 2-layer tower"),
    ("llava_tiny", _set(multimodal_projector_bias="no"), FormatError,
     "multimodal_projector_bias must be true or false, got 'no'"),
    ("llava_tiny", _set(image_token_index=[]), FormatError,
     "image_token_index must be one token id, got \\[\\]"),
    ("llava_tiny", lambda cfg: cfg["text_config"].update(rms_norm_eps=NAN), FormatError,
     r"\(text_config\): rms_norm_eps must be a finite number, got nan"),
]

GEN_CASES = [   # generation_config.json wins over config.json for these
    ("suppress_tokens", [1, 256], "suppress_tokens holds token id 256, not below vocab_size 256"),
    ("begin_suppress_tokens", [-1], "begin_suppress_tokens must be a token id"),
    ("decoder_start_token_id", [], "decoder_start_token_id must be one token id, got \\[\\]"),
    ("forced_decoder_ids", [[1, 999]],
     "forced_decoder_ids must be \\[position, token id < vocab_size 256 or null\\] pairs"),
    ("no_timestamps_token_id", 300, "no_timestamps_token_id holds token id 300"),
    ("lang_to_id", {"<|en|>": -3}, "lang_to_id must map token texts to ids below"),
    ("task_to_id", {"<|transcribe|>": 256}, "task_to_id must map token texts to ids below"),
]


def _write(tmp_path, name, edit, gen_edit=None):
    """config.json (edited), generation_config.json and links to the weights of fixture
    `name`."""
    cfg = _config(name)
    edit(cfg)
    d = tmp_path / name
    d.mkdir()
    for f in (FIXTURES / name).iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
            (d / f.name).symlink_to(f)
    (d / "config.json").write_text(json.dumps(cfg))   # NaN / Infinity as Python writes them
    gen = FIXTURES / name / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        if gen_edit:
            gen_edit(g)
        (d / "generation_config.json").write_text(json.dumps(g))
    return d


@pytest.mark.parametrize("name, edit, cls, says", CASES,
                         ids=[f"{i}-{n}" for i, (n, *_) in enumerate(CASES)])
def test_bad_value_is_refused_at_load_naming_file_field_and_value(tmp_path, name, edit, cls,
                                                                  says):
    d = _write(tmp_path, name, edit)
    with pytest.raises(cls, match=re.escape(str(d / "config.json")) + ".*" + says):
        metrale.load(d, HostBackend(), progress=False)


@pytest.mark.parametrize("key, value, says", GEN_CASES)
def test_bad_generation_config_id_is_refused(tmp_path, key, value, says):
    d = _write(tmp_path, "whisper_tiny", lambda c: None, lambda g: g.update({key: value}))
    with pytest.raises(FormatError,
                       match=re.escape(str(d / "generation_config.json")) + ": " + says):
        metrale.load(d, HostBackend(), progress=False)


def test_values_at_the_edge_of_their_range_load(tmp_path):
    """What HF accepts and computes finitely is not refused: eps 0, a factor below 1, yarn
    beta 0 / null (HF's defaults), truncate null (HF: no truncation), high < low."""
    from metrale.formats.metadata import ModelMetadata
    from metrale.ops import rope
    for edit in (_set(rms_norm_eps=0.0), _rope(rope_type="linear", factor=0.5),
                 _rope(**{**YARN, "beta_fast": 0, "beta_slow": None, "truncate": None}),
                 _rope(**{**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0})):
        cfg = _config("llama_gqa")
        edit(cfg)
        m = ModelMetadata.from_config(cfg)
        table = rope.rope_table(m.head_dim, 64, m.rope_theta, m.rope_scaling)
        assert np.all(np.isfinite(table))
    cfg = _config("llama_gqa")
    _rope(**{**YARN, "truncate": None})(cfg)
    assert ModelMetadata.from_config(cfg).rope_scaling.truncate is False


def test_whisper_scale_embedding_changes_nothing_as_in_transformers(tmp_path):
    """transformers 5.25's WhisperDecoder sets embed_scale = sqrt(d_model) when
    scale_embedding is true but never multiplies by it (its logits are bit-identical either
    way: checked with the fixture in /work/torchvenv); metrale follows it."""
    import shutil
    from tests.whisper.common import golden
    g = golden()
    ids = g["decoder_input_ids"][0].tolist()
    enc = g["encoder"][None].astype(np.float32)
    d = tmp_path / "w"
    shutil.copytree(FIXTURES / "whisper_tiny", d)
    base = metrale.load(d, HostBackend(), progress=False)
    want = base.decode_step(ids, enc)
    base.close()
    cfg = json.loads((d / "config.json").read_text())
    cfg["scale_embedding"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    m = metrale.load(d, HostBackend(), progress=False)
    assert m.metadata().whisper.scale_embedding is True
    assert np.array_equal(m.decode_step(ids, enc), want)
    m.close()


@pytest.mark.parametrize("gen", [{"do_sample": True, "temperature": NAN},
                                 {"repetition_penalty": INF}, {"max_new_tokens": -3},
                                 {"do_sample": True, "top_p": -0.5}])
def test_generation_config_numbers_are_finite_and_not_negative(gen):
    from metrale.engine import generation_defaults
    key = next(k for k in gen if k != "do_sample")
    with pytest.raises(FormatError, match=f"x/generation_config.json: {key} must be a finite "
                                          "number >= 0"):
        generation_defaults(gen, "x/generation_config.json")
