"""GGUF files as ModelSources (formats/gguf*.py): the header parser against the `gguf`
package's reader, config and metadata against transformers' reading of the same files,
the rotary row permutation, and every refusal naming what it refuses."""
from __future__ import annotations

import json

import numpy as np
import pytest

from metrale.errors import FormatError, Unsupported
from metrale.formats import ModelMetadata, open_source
from metrale.formats.gguf.source import GGUFSource, hf_name, unpermute_rows
from metrale.formats.gguf.config import f32_value
from metrale.formats.gguf.file import GGUFFile
from metrale.formats.gguf.quants import dequantize_bf16
from tests.formats.gguf_util import GGUF_FIXTURES, rewrite

MODELS = ["llama", "qwen2", "qwen3"]


def golden(name):
    with np.load(GGUF_FIXTURES / f"{name}.npz") as g:
        return {k: g[k] for k in g.files}


@pytest.mark.parametrize("name", MODELS + ["spm_tokenizer"])
def test_parser_matches_the_gguf_package_reader(name):
    gguf = pytest.importorskip("gguf")
    path = GGUF_FIXTURES / f"{name}.gguf"
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        want = theirs.fields[k].contents()
        got = ours.fields[k]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == want, k
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in reversed(t.shape)), t.name
        assert info.ggml_type == int(t.tensor_type) and info.nbytes == t.n_bytes
        assert np.array_equal(ours.raw(t.name), t.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", MODELS)
def test_config_agrees_with_transformers(name):
    """Shape fields, and the float32-stored eps / rope base equal to HF's as float32 (HF
    keeps the widened float64, metrale its shortest decimal)."""
    src = open_source(GGUF_FIXTURES / f"{name}.gguf")
    meta, g = src.metadata(), golden(name)
    assert isinstance(src, GGUFSource) and meta.architecture == name
    assert np.float32(meta.rms_norm_eps) == np.float32(g["rms_norm_eps"])
    assert np.float32(meta.rope_theta) == np.float32(g["rope_theta"])
    assert meta.rms_norm_eps == (1e-5 if name == "llama" else 1e-6)
    assert meta.vocab_size == g["logits"].shape[1]
    assert meta.tie_word_embeddings == (name == "qwen2")
    assert meta.attention_bias == (name == "qwen2") and meta.qk_norm == (name == "qwen3")
    assert meta.head_dim == (128 if name == "qwen3" else 16)
    assert meta.bos_token_id == 1 and meta.eos_token_ids == (2,)


def test_shortest_float32_decimal():
    assert f32_value(np.float32(1e-5)) == 1e-5
    assert f32_value(9.999999747378752e-06) == 1e-5
    assert f32_value(np.float32(1e-6)) == 1e-6 and f32_value(500000.0) == 500000.0
    for x in np.random.default_rng(0).standard_normal(200).astype(np.float32):
        assert np.float32(f32_value(x)) == x


def test_tensor_names_map_to_the_hf_layout():
    src = open_source(GGUF_FIXTURES / "llama.gguf")
    assert "model.layers.1.mlp.down_proj.weight" in src.tensor_names()
    assert src.tensor_dtype("model.layers.0.mlp.down_proj.weight") == "Q4_K"
    assert src.tensor_shape("model.embed_tokens.weight") == (320, 64)
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.0.ffn_gate_exps.weight") is None


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rows -> GGUF rows)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, d, cols in ((4, 16, 8), (3, 64, 5), (1, 2, 1)):
        w = rng.standard_normal((heads * d, cols))
        assert np.array_equal(unpermute_rows(permute(w, heads), heads), w)
        b = rng.standard_normal(heads * d)
        assert np.array_equal(unpermute_rows(permute(b, heads), heads), b)
    # row h*d + 2i + j of the GGUF is HF row h*d + j*d/2 + i
    hf = np.arange(16)[:, None]
    assert permute(hf, 2)[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("name, permuted", [("llama", True), ("qwen2", False)])
def test_q_k_rows_are_unpermuted_for_llama_only(name, permuted):
    src = open_source(GGUF_FIXTURES / f"{name}.gguf")
    meta, f = src.metadata(), src.file
    for proj, heads in (("q", meta.num_heads), ("k", meta.num_kv_heads), ("v", None)):
        info = f.tensors[f"blk.0.attn_{proj}.weight"]
        stored = dequantize_bf16(f.raw(info.name), info.ggml_type, info.shape)
        got = src.read_bf16(f"model.layers.0.self_attn.{proj}_proj.weight")
        want = unpermute_rows(stored, heads) if permuted and heads else stored
        assert np.array_equal(got, want), proj


def test_linear_rope_and_stop_tokens_match_the_equivalent_config(tmp_path):
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "m.gguf",
                {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.5,
                 "tokenizer.ggml.eot_token_id": 0})
    meta = open_source(p).metadata()
    cfg = dict(open_source(GGUF_FIXTURES / "llama.gguf").config())
    cfg.update(rope_scaling={"rope_type": "linear", "factor": 2.5}, eos_token_id=[2, 0])
    assert meta == ModelMetadata.from_config(cfg)
    assert meta.rope_scaling.rope_type == "linear" and meta.eos_token_ids == (2, 0)


REFUSALS = [
    ({"llama.expert_count": 8}, "llama.expert_count"),
    ({"llama.attention.causal": False}, "llama.attention.causal"),
    ({"llama.attention.max_alibi_bias": 8.0}, "llama.attention.max_alibi_bias"),
    ({"llama.attention.sliding_window": 4096}, "llama.attention.sliding_window"),
    ({"llama.use_parallel_residual": True}, "llama.use_parallel_residual"),
    ({"llama.attention.layer_norm_epsilon": 1e-5}, "llama.attention.layer_norm_epsilon"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "yarn"),
    ({"llama.logit_scale": 0.5}, "llama.logit_scale"),
    ({"llama.rope.dimension_count": 8}, "partial rotary"),
    ({"general.type": "adapter"}, "general.type"),
    ({"split.count": 3}, "split.count"),
    ({"clip.has_vision_encoder": True}, "clip.has_vision_encoder"),
    ({"tokenizer.ggml.precompiled_charsmap": [1, 2]}, "precompiled_charsmap"),
    ({"general.quantization_version": 1}, "general.quantization_version"),
]


@pytest.mark.parametrize("keys, named", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_math_changing_keys_are_refused_by_name(tmp_path, keys, named):
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "m.gguf", keys)
    with pytest.raises(Unsupported, match=named.replace(".", r"\.")):
        open_source(p)


def test_other_architectures_and_tensors_are_refused(tmp_path):
    # Gemma 1 (metrale has no such family): refused by its name, the supported ones listed
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "a.gguf", arch="gemma",
                set_keys={f"gemma.{k[6:]}": v for k, v in
                          GGUFFile(GGUF_FIXTURES / "llama.gguf").fields.items()
                          if k.startswith("llama.") and not isinstance(v, np.ndarray)},
                drop=[k for k in GGUFFile(GGUF_FIXTURES / "llama.gguf").fields
                      if k.startswith("llama.")])
    with pytest.raises(Unsupported, match=r"general\.architecture 'gemma' is not supported "
                       r"\(supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3\)"):
        open_source(p)
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "r.gguf",
                add_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(Unsupported, match="rope_freqs"):
        open_source(p)
    import metrale
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "x.gguf",
                add_tensors={"blk.0.ffn_gate_exps.weight": np.ones((2, 64))})
    with pytest.raises(FormatError, match="blk.0.ffn_gate_exps.weight"):
        metrale.load(p, "cpu", progress=False)


def test_unsupported_tensor_types_are_refused_by_name(tmp_path):
    from gguf import GGMLQuantizationType as T
    blocks = np.zeros((64, 74), np.uint8)                  # IQ2_XS: 256 elements, 74 B
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "q.gguf",
                drop_tensors=["blk.1.ffn_down.weight"],
                add_tensors={"blk.1.ffn_down.weight": (blocks, T.IQ2_XS)})
    with pytest.raises(Unsupported,
                       match=r"IQ2_XS \(1 tensor, e\.g\. blk\.1\.ffn_down\.weight\)"):
        open_source(p)


@pytest.mark.parametrize("damage, match", [
    (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
    (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "version 1"),
    (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian"),
    (lambda b: b[:5000], "truncated|past the end"),
])
def test_broken_files_are_format_errors(tmp_path, damage, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(damage((GGUF_FIXTURES / "llama.gguf").read_bytes()))
    with pytest.raises(FormatError, match=match):
        open_source(p)


def test_chat_template_and_special_tokens():
    src = open_source(GGUF_FIXTURES / "llama.gguf")
    assert "<|im_start|>" in src.chat_template()
    assert src.special_tokens() == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                    "pad_token": "<|endoftext|>"}
    from metrale.engine.chat import apply_chat_template
    want = json.loads((GGUF_FIXTURES / "tokenizers.json").read_text())["llama"]["chat_ids"]
    assert apply_chat_template(src, [{"role": "user", "content": "Hello there"}]) == want


@pytest.mark.parametrize("name", MODELS)
def test_read_bf16_into_equals_read_bf16(name):
    src = open_source(GGUF_FIXTURES / f"{name}.gguf")
    for t in src.tensor_names():
        want = src.read_bf16(t)
        out = np.full(want.size, 0xABCD, np.uint16)
        src.read_bf16_into(t, out)
        assert np.array_equal(out.reshape(want.shape), want), t
    with pytest.raises(FormatError, match="uint16 buffer"):
        src.read_bf16_into("model.norm.weight", np.zeros(3, np.uint16))


def test_direct_upload_writes_the_same_device_bytes():
    """HostBackend.write_host (the dequantizer writes into device memory) and the staged
    copy_h2d path upload the same bits (loads that dequantize at load)."""
    import metrale
    from metrale.gpu_runtime import HostBackend
    path = GGUF_FIXTURES / "llama.gguf"
    direct = metrale.load(path, HostBackend(), progress=False, gguf_dequantize=True)

    class Staged:                 # the same source without read_bf16_into
        def __init__(self, s):
            self._s = s

        def __getattr__(self, k):
            if k == "read_bf16_into":
                raise AttributeError(k)
            return getattr(self._s, k)

    staged = metrale.load(Staged(open_source(path)), HostBackend(), progress=False,
                          gguf_dequantize=True)
    for a, b in ((direct._weights.embed_tokens, staged._weights.embed_tokens),
                 (direct._weights.layers[1].qkv, staged._weights.layers[1].qkv),
                 (direct._weights.layers[1].gate_up, staged._weights.layers[1].gate_up)):
        n = direct.backend.find_allocation(a)[1]
        assert np.array_equal(direct.backend.read(a, n, np.uint8),
                              staged.backend.read(b, n, np.uint8))


def test_cli_takes_gguf_paths(capsys):
    from metrale.cli import main
    path = str(GGUF_FIXTURES / "qwen2.gguf")
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "GGUF MOSTLY_Q8_0" in out and "Q6_K" in out and "tokenizer.ggml" in out
    assert main(["generate", path, "--chat", "--prompt", "Hello there", "--max-new-tokens",
                 "3", "--ignore-eos", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    want = json.loads((GGUF_FIXTURES / "tokenizers.json").read_text())["qwen2"]["chat_ids"]
    assert f"3 tokens (length); {len(want)} prompt tokens" in err


def test_info_reports_the_stored_types_not_a_float_dtype(capsys):
    """`info --json` on a GGUF said "dtype": "float32" (the config it stands for); it
    names the file type and the stored types per tensor group, counts them, and says how
    the device holds them (the plain text too)."""
    from collections import Counter
    from metrale.cli import main
    path = str(GGUF_FIXTURES / "qwen2.gguf")
    assert main(["info", path, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["dtype"] == ("GGUF MOSTLY_Q8_0 (general.file_type): token_embd Q8_0, attention "
                          "F16/Q4_0/Q4_1/Q8_0, ffn Q4_1/Q4_K/Q6_K/Q8_0, biases F32, norms F32")
    assert d["device_dtype"] == "bfloat16"
    assert d["stored_dtypes"] == dict(Counter(t.type_name for t in
                                              GGUFFile(path).tensors.values()))
    # what the device holds: block types at their stored bytes, qwen2's layer groups with
    # an F16 q_proj dequantized at load (gguf_weights.py), the rest bfloat16
    assert "9 tensors (Q4_0/Q4_1/Q4_K/Q6_K/Q8_0) kept at their stored bytes on the device" \
        in d["math"]["dtype"]
    assert "4 block-type tensors dequantized to bfloat16 at load (in a fused group with a " \
        "float part, e.g. model.layers.0.self_attn.k_proj.weight)" in d["math"]["dtype"]
    assert d["held_dtypes"] == {"BF16": 17, "Q4_0": 2, "Q4_1": 2, "Q4_K": 1, "Q6_K": 1,
                                "Q8_0": 3}
    # weight bytes as held, what a packed load holds (the BF16 ones said too)
    import metrale
    held = metrale.load(path, "cpu", progress=False).weight_bytes()
    bf16 = metrale.load(path, "cpu", progress=False, gguf_dequantize=True).weight_bytes()
    assert d["weight_bytes"] == held == 128560 and bf16 == 276992
    assert main(["info", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("dtype"))
    assert d["dtype"] in line and "float32 in" not in line
    assert "weights        125.5 KiB as held (block types at their stored bytes; 270.5 KiB " \
        "dequantized at load with gguf_dequantize=True)" in lines
    # a file without a fused group of mixed float / block parts: nothing dequantized at load
    assert main(["info", str(GGUF_FIXTURES / "llama.gguf"), "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["math"]["dtype"]
    assert "dequantized to bfloat16 at load" not in text and "15 tensors" in text
