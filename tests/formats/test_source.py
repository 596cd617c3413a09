"""DirectorySource / MemorySource / open_source, sharded checkpoints, and the fixtures."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metrale import FormatError, InvalidArgument, Unsupported
from metrale.formats import (PRESETS, DirectorySource, MemorySource, ModelSource,
                             check_tensors, expected_tensors, num_parameters, open_source)
from metrale.formats.hybrid_config import HYBRID_ARCHS
from metrale.formats.hybrid_layout import skipped
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16

from .st_util import tiny_config, write_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# the quantized fixtures (q_*) hold packed tensors: tests/formats/test_quant_formats.py
FIXTURE_DIRS = sorted(p.name for p in FIXTURES.iterdir()
                      if (p / "config.json").is_file() and not p.name.startswith("q_"))


def _tensors(cfg, rng):
    # finite values: a NaN's payload is quieted by the F32 -> BF16 conversion of F32 shards
    src = MemorySource.from_config(cfg)
    return {n: f32_to_bf16(rng.standard_normal(s).astype(np.float32))
            for n, s in expected_tensors(src.metadata()).items()}


@pytest.mark.parametrize("name", FIXTURE_DIRS)
def test_fixture_parses_and_passes_check(name):
    src = open_source(FIXTURES / name)
    m = src.metadata()
    held = src.tensor_names()
    if m.hybrid is not None:   # the MTP head and a wrapper's vision tower are skipped
        held = [n for n in held if not skipped(n)]
    if m.moe is not None and m.moe.oss is not None and m.moe.oss.mxfp4:
        from metrale.formats.quant.mxfp4_check import check_mxfp4
        check_mxfp4(src, expected_tensors(m, held))   # packed U8 experts
    else:
        check_tensors(src, expected_tensors(m, held), complete=m.hybrid is None)
    # a gemma3 checkpoint's vision tower is held but not loaded (its text model runs)
    loaded = {n for n in held if not n.startswith(src.unloaded_prefixes)}
    assert loaded == set(expected_tensors(m, held))
    assert isinstance(src, ModelSource)
    assert m.architecture in {"llama", "mistral", "qwen2", "qwen3", "whisper", "llava",
                              "qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
                              "gemma3", "phi3", "gpt_oss", "deepseek_v2", "deepseek_v3",
                              "glm4_moe", "glm4_moe_lite", *HYBRID_ARCHS}
    golden = np.load(FIXTURES / name / "golden.npz")
    if m.architecture not in ("whisper", "llava"):
        s = golden["input_ids"].shape[1]
        assert golden["logits"].shape == (s, m.vocab_size)
        assert golden["hidden"].shape == (s, m.hidden_size)


def test_fixtures_cover_the_rope_styles():
    cfg = {n: json.loads((FIXTURES / n / "config.json").read_text()) for n in FIXTURE_DIRS}
    assert "rope_scaling" in cfg["llama_gqa"] and "rope_parameters" not in cfg["llama_gqa"]
    assert cfg["qwen2"]["rope_scaling"]["type"] == "linear"
    assert "rope_parameters" in cfg["qwen3"]
    m = open_source(FIXTURES / "llama_gqa").metadata()
    assert m.rope_scaling.rope_type == "llama3" and m.rope_theta == 500000.0
    m = open_source(FIXTURES / "llama_mqa_tied").metadata()
    assert m.head_dim == 32 and m.num_kv_heads == 1 and m.tie_word_embeddings
    m = open_source(FIXTURES / "qwen3").metadata()
    assert m.rope_scaling.rope_type == "yarn" and m.qk_norm
    assert open_source(FIXTURES / "llama_gqa").metadata().eos_token_ids == (2, 3)  # gen config


def test_directory_roundtrip_and_tokenizer(tmp_path, rng):
    cfg = tiny_config()
    tensors = _tensors(cfg, rng)
    d = write_checkpoint(tmp_path / "ck", cfg, tensors, {"eos_token_id": [2, 5]})
    src = open_source(d)
    assert src.description == str(d) and src.tokenizer_path() is None
    assert src.generation_config() == {"eos_token_id": [2, 5]}
    assert src.metadata().eos_token_ids == (2, 5)
    check_tensors(src, expected_tensors(src.metadata()))
    for n, v in tensors.items():
        np.testing.assert_array_equal(src.read_bf16(n), v)
        assert src.tensor_dtype(n) == "BF16"
    (d / "tokenizer.json").write_text("{}")
    assert src.tokenizer_path() == d / "tokenizer.json"
    # a single .safetensors file next to its config.json
    assert open_source(d / "model.safetensors").tensor_names() == src.tensor_names()


def test_sharded_index(tmp_path, rng):
    cfg = tiny_config()
    tensors = _tensors(cfg, rng)
    d = write_checkpoint(tmp_path / "sh", cfg, tensors, shards=3)
    src = open_source(d)
    assert "index.json" in src.weights_description
    check_tensors(src, expected_tensors(src.metadata()))
    for n, v in tensors.items():
        np.testing.assert_array_equal(src.read_bf16(n), v)  # F32 shards round-trip exactly
    assert {Path(src.tensor_file(n)).name for n in tensors} == \
        {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}


def test_sharded_index_errors(tmp_path, rng):
    cfg = tiny_config()
    d = write_checkpoint(tmp_path / "sh", cfg, _tensors(cfg, rng), shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    other = "model-00002-of-00002.safetensors"
    bad = dict(index, weight_map={**index["weight_map"], name: other})
    (d / "model.safetensors.index.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match=rf"index.json: tensor '{name}' is listed in {other}"):
        open_source(d)
    bad = dict(index, weight_map={**index["weight_map"], name: "../evil.safetensors"})
    (d / "model.safetensors.index.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match="shard '../evil.safetensors'"):
        open_source(d)
    (d / "model-00001-of-00002.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="model-00001-of-00002.safetensors"):
        open_source(d)


def test_missing_tensor_and_wrong_shape(tmp_path, rng):
    cfg = tiny_config()
    tensors = _tensors(cfg, rng)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    d = write_checkpoint(tmp_path / "a", cfg, tensors)
    src = open_source(d)
    with pytest.raises(FormatError, match=r"a/model.safetensors: missing tensor "
                                          r"'model.layers.0.mlp.up_proj.weight'"):
        check_tensors(src, expected_tensors(src.metadata()))
    tensors = _tensors(cfg, rng)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    d = write_checkpoint(tmp_path / "b", cfg, tensors)
    src = open_source(d)
    with pytest.raises(FormatError, match=r"b/model.safetensors: tensor 'model.norm.weight' "
                                          r"has shape \[31\] but config.json implies \[32\]"):
        check_tensors(src, expected_tensors(src.metadata()))


def test_tied_checkpoint_without_lm_head(tmp_path, rng):
    cfg = tiny_config(tie_word_embeddings=True)
    d = write_checkpoint(tmp_path / "t", cfg, _tensors(cfg, rng))
    src = open_source(d)
    assert "lm_head.weight" not in src.tensor_names()
    check_tensors(src, expected_tensors(src.metadata()))
    # untied config over the same weights: lm_head is missing
    (d / "config.json").write_text(json.dumps(tiny_config()))
    src = open_source(d)
    with pytest.raises(FormatError, match="missing tensor 'lm_head.weight'"):
        check_tensors(src, expected_tensors(src.metadata()))


def test_missing_config_and_bad_json(tmp_path, rng):
    cfg = tiny_config()
    d = write_checkpoint(tmp_path / "c", cfg, _tensors(cfg, rng))
    (d / "config.json").unlink()
    with pytest.raises(FormatError, match=r"c/config.json: missing"):
        open_source(d)
    (d / "config.json").write_text("{oops")
    with pytest.raises(FormatError, match=r"c/config.json: not valid JSON"):
        open_source(d)
    (d / "config.json").write_text(json.dumps(tiny_config(model_type="bert")))
    with pytest.raises(Unsupported, match=r"c/config.json: model_type 'bert'"):
        open_source(d).metadata()


def test_pickle_only_directory_is_refused(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config()))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 not really pickle")
    with pytest.raises(FormatError, match=r"only pickle weights \(pytorch_model.bin\).*"
                                          r"convert the checkpoint to safetensors"):
        open_source(d)
    with pytest.raises(FormatError, match="convert it to safetensors"):
        open_source(d / "pytorch_model.bin")
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(FormatError, match="no model.safetensors"):
        open_source(d)


def test_open_source_arguments(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        open_source(tmp_path / "nope")
    with pytest.raises(FormatError, match="cannot open 3"):
        open_source(3)
    src = MemorySource.preset("tiny")
    assert open_source(src) is src
    assert open_source("preset:tiny").description == "preset:tiny"
    with pytest.raises(InvalidArgument, match="unknown preset 'huge'"):
        MemorySource.preset("huge")


def test_memory_source_deterministic_and_lazy():
    a, b = MemorySource.preset("tiny", seed=0), MemorySource.preset("tiny", seed=0)
    c = MemorySource.preset("tiny", seed=1)
    n = "model.layers.0.self_attn.q_proj.weight"
    x = a.read_bf16(n)
    assert x.shape == (128, 128) and x.dtype == np.uint16
    np.testing.assert_array_equal(x, b.read_bf16(n))
    assert not np.array_equal(x, c.read_bf16(n))
    assert not np.array_equal(x, a.read_bf16("model.layers.1.self_attn.q_proj.weight"))
    f = bf16_to_f32(x)
    assert abs(f.std() - 0.02) < 0.002 and abs(f.mean()) < 0.002
    norm = bf16_to_f32(a.read_bf16("model.layers.0.input_layernorm.weight"))
    assert abs(norm.mean() - 1.0) < 0.01
    check_tensors(a, expected_tensors(a.metadata()))
    assert num_parameters(a.metadata()) == sum(int(np.prod(a.tensor_shape(t)))
                                                for t in a.tensor_names())


@pytest.mark.parametrize("name", [p for p in PRESETS if not p.startswith("tiny")])
def test_real_shape_presets_generate_fast(name):
    src = MemorySource.preset(name)
    m = src.metadata()
    big = max(src.tensor_names(), key=lambda t: np.prod(src.tensor_shape(t)))
    x = src.read_bf16(big)  # the embedding: ~0.5-1.2 GB of float32 temporaries avoided
    assert x.shape == src.tensor_shape(big) and x.dtype == np.uint16
    assert np.isfinite(bf16_to_f32(x[:4])).all()
    assert num_parameters(m) > 2e8


def test_from_config_and_protocol():
    src = MemorySource.from_config(tiny_config(model_type="qwen3"), seed=3)
    assert isinstance(src, ModelSource) and src.tokenizer_path() is None
    assert src.generation_config() is None and src.config()["model_type"] == "qwen3"
    with pytest.raises(FormatError, match="missing tensor 'x'"):
        src.read_bf16("x")
    assert isinstance(DirectorySource(FIXTURES / "qwen3"), ModelSource)


def test_llava_new_transformers_key_layout_is_mapped(tmp_path):
    # transformers >= 4.52 LlavaForConditionalGeneration state-dict names
    src = open_source(FIXTURES / "llava_tiny")
    renamed = {}
    for n in src.tensor_names():
        arr = np.array(src.read_bf16(n))
        if n.startswith("language_model.model."):
            n = "model.language_model." + n[len("language_model.model."):]
        elif n == "language_model.lm_head.weight":
            n = "lm_head.weight"
        elif n.startswith("vision_tower.vision_model."):
            n = "model.vision_tower.vision_model." + n[len("vision_tower.vision_model."):]
        else:
            n = "model." + n
        renamed[n] = arr
    d = write_checkpoint(tmp_path / "lv", src.config(), renamed)
    new = open_source(d)
    check_tensors(new, expected_tensors(new.metadata()))
    assert sorted(new.tensor_names()) == sorted(src.tensor_names())
