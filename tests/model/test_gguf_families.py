"""The GGUF architectures beyond llama (qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3): each
family's tiny HF fixture written as llama.cpp's converter writes it
(tests/fixtures/make_gguf_families.py) loads as the model the fixture is. Logits from the
F32 and BF16 files are bit-equal to those of the HF checkpoint directory (same weights, the
config the architecture fixes: make_gguf_families.FIXED_CONFIG); from the Q8_0 file (kept
packed) they match the directory of its dequantized weights within the tolerance table,
through the pointer API and the tensor API on HostBackend, and (marked gpu) on the emulated
kernels. A file missing a key its architecture needs is refused naming the key."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.errors import FormatError, Unsupported
from metrale.formats import ModelMetadata, open_source
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend
from metrale.model_engine.linear import GgufLinear
from tests.conftest import TOL, rel_max_error
from tests.fixtures.make_gguf_families import (FAMILIES, HERE as FIXTURES, reference_config,
                                               reference_dir, write_gguf)
from tests.formats.gguf_util import rewrite
from tests.model.common import logits_rows

ARCHS = list(FAMILIES)
IDS = np.random.default_rng(7).integers(3, 256, 24).tolist()
_MADE: dict = {}


def made(tmp_path_factory, arch: str, outtype: str):
    """(GGUF path, reference checkpoint directory, weights) of `arch` in `outtype`, once."""
    key = (arch, outtype)
    if key not in _MADE:
        d = tmp_path_factory.mktemp(f"{arch}-{outtype}")
        weights = write_gguf(arch, d / f"{arch}.gguf", outtype)
        _MADE[key] = (d / f"{arch}.gguf", reference_dir(arch, weights, d / "hf"), weights)
    return _MADE[key]


def teacher_forced(path, be, prefix: int = 16) -> np.ndarray:
    """[len(IDS) - prefix + 1, vocab] logits: prefill IDS[:prefix], then decode the rest."""
    m = metrale.load(path, be, progress=False)
    try:
        s, seq = m.default_stream(), m.alloc_sequence()
        rows = [logits_rows(m, m.prefill(IDS[:prefix], seq, s))[0]]
        rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in IDS[prefix:]]
        packed = any(isinstance(x, GgufLinear) for x in
                     [m._weights.embed_tokens] + [L.o_proj for L in m._weights.layers])
        return np.stack(rows), packed
    finally:
        m.teardown()


def all_logits(path) -> np.ndarray:
    gm = metrale.load_generative(path, HostBackend(), progress=False)
    with gm.create_kv_cache(CacheConfig(max_seq_len=len(IDS))) as cache:
        return to_numpy(gm.prefill_all_logits(gm.embed(np.array([IDS])), cache,
                                              range(len(IDS))))[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_is_the_fixtures(arch, tmp_path_factory):
    """The config the metadata stands for parses to the fixture's (with the fields the
    architecture fixes); dtype aside (the GGUF's float32 label)."""
    path, ref, _ = made(tmp_path_factory, arch, "bf16")
    got = open_source(path).metadata()
    want = ModelMetadata.from_config(reference_config(arch))
    assert replace(got, dtype=want.dtype) == want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_float_files_give_the_checkpoints_logits_bit_for_bit(arch, outtype,
                                                             tmp_path_factory):
    path, ref, weights = made(tmp_path_factory, arch, outtype)
    src, orig = open_source(ref), open_source(FIXTURES / FAMILIES[arch])
    # the reference directory holds the fixture's own weights, bit for bit
    for n in src.tensor_names():
        assert np.array_equal(src.read_bf16(n), orig.read_bf16(n)), n
    got, _ = teacher_forced(path, HostBackend())
    want, _ = teacher_forced(ref, HostBackend())
    assert np.array_equal(got, want), f"{arch} {outtype}: max diff {np.abs(got - want).max()}"
    assert np.array_equal(all_logits(path), all_logits(ref))


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_file_matches_its_dequantized_weights(arch, tmp_path_factory):
    path, ref, _ = made(tmp_path_factory, arch, "q8_0")
    got, packed = teacher_forced(path, HostBackend())
    assert packed, "nothing stayed packed"
    want, _ = teacher_forced(ref, HostBackend())
    # within the table's bound; measured bit-equal (the packed GEMM's twin is the
    # load-time dequantizer's bits through the same BF16 GEMM: ops/gemm_gguf.py)
    for kind, a, b in (("pointer API", got, want),
                       ("tensor API", all_logits(path), all_logits(ref))):
        err = rel_max_error(a, b)
        assert err <= TOL["model_device_vs_host_rel_max"][0], f"{arch} {kind}: {err}"
        assert np.array_equal(a, b), f"{arch} {kind}: {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_file_on_the_kernels(arch, device, tmp_path_factory):
    """The packed Q8_0 kernels (emu: kernels/*.cu on the CPU) against the twins' logits of
    the dequantized weights."""
    path, ref, _ = made(tmp_path_factory, arch, "q8_0")
    got, packed = teacher_forced(path, device)
    assert packed
    want, _ = teacher_forced(ref, HostBackend())
    err = rel_max_error(got, want)
    assert err <= TOL["model_device_vs_host_rel_max"][0], f"{arch} on {device.name}: {err}"


REQUIRED = {"qwen2": "qwen2.embedding_length", "qwen3": "qwen3.rope.scaling."
            "original_context_length", "qwen3moe": "qwen3moe.expert_feed_forward_length",
            "phi3": "phi3.attention.head_count", "gemma2": "gemma2.attention.sliding_window",
            "gemma3": "gemma3.block_count"}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_missing_required_key_is_refused_by_name(arch, tmp_path_factory, tmp_path):
    path, _, _ = made(tmp_path_factory, arch, "bf16")
    p = rewrite(path, tmp_path / "m.gguf", drop=[REQUIRED[arch]])
    with pytest.raises((FormatError, Unsupported), match=REQUIRED[arch].replace(".", r"\.")):
        open_source(p)


@pytest.mark.parametrize("arch", ARCHS)
def test_info(arch, tmp_path_factory, capsys):
    from metrale.cli import main
    path, _, _ = made(tmp_path_factory, arch, "q8_0")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert FAMILIES[arch] in out and "Q8_0" in out and "tokenizer.ggml" in out
    tok = open_source(path).tokenizer()
    assert tok.decode(tok.encode("hello there").ids) == "hello there"


REFUSED = [
    ("qwen2", {"qwen2.final_logit_softcapping": 30.0}, Unsupported,
     r"'qwen2\.final_logit_softcapping' is not read for architecture 'qwen2'"),
    ("qwen3moe", {"qwen3moe.expert_weights_norm": False}, Unsupported,
     r"qwen3moe\.expert_weights_norm = false"),
    ("qwen3moe", {"qwen3moe.expert_count": 4}, FormatError,
     r"qwen3moe\.expert_count = 4 but blk\.0\.ffn_gate_inp\.weight has 8 rows"),
    ("qwen3moe", {"qwen3moe.expert_used_count": 9}, FormatError,
     r"expert_used_count = 9 exceeds"),
    ("phi3", {"phi3.rope.dimension_count": 7}, FormatError, r"phi3\.rope\.dimension_count"),
    ("gemma2", {"gemma2.rope.scaling.type": "yarn", "gemma2.rope.scaling.factor": 4.0},
     Unsupported, r"gemma2\.rope\.scaling\.type 'yarn' is not supported"),
    ("gemma3", {"gemma3.expert_count": 8}, Unsupported, r"gemma3\.expert_count = 8"),
]


@pytest.mark.parametrize("arch, keys, error, match", REFUSED,
                         ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSED])
def test_values_an_architecture_does_not_read_are_refused(arch, keys, error, match,
                                                          tmp_path_factory, tmp_path):
    path, _, _ = made(tmp_path_factory, arch, "bf16")
    with pytest.raises(error, match=match):
        open_source(rewrite(path, tmp_path / "m.gguf", keys))


def test_phi3_longrope_factors_are_refused_by_name(tmp_path_factory, tmp_path):
    path, _, _ = made(tmp_path_factory, "phi3", "bf16")
    p = rewrite(path, tmp_path / "m.gguf", add_tensors={"rope_factors_long.weight":
                                                        np.ones(4)})
    with pytest.raises(Unsupported, match=r"'rope_factors_long\.weight' \(Phi-3's LongRoPE"):
        open_source(p)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_key_read_or_written_is_in_the_field_table(arch, tmp_path_factory):
    from metrale.formats.gguf.config import classify, hf_config
    from metrale.formats.gguf.file import GGUFFile
    from tests.formats.test_gguf_field_table import Recording
    g = GGUFFile(made(tmp_path_factory, arch, "bf16")[0])
    log: set = set()
    hf_config(Recording(g.fields, log), g.tensors, arch)
    assert any(k.startswith(arch + ".") for k in log)
    assert not [k for k in log | set(g.fields) if classify(k, arch) is None]


@pytest.mark.parametrize("arch, layers, scalar", [
    ("gemma2", 26, 256), ("gemma2", 42, 256), ("gemma2", 46, 144),
    ("gemma3", 34, 256), ("gemma3", 62, 168)])
def test_gemma_query_scale_is_llama_cpps(arch, layers, scalar):
    """llama.cpp's f_attention_scale: (hidden / heads) ** -0.5 for the 27B models (46 / 62
    layers; their HF query_pre_attn_scalar is 144 / 168), head_dim ** -0.5 otherwise."""
    from metrale.formats.gguf.archs import family_config
    hidden, heads = {"gemma2": (4608, 32), "gemma3": (5376, 32)}[arch]
    values = {"attention.sliding_window": 4096}
    cfg = family_config(arch, lambda name, default=None, required=False:
                        values.get(name, default), {}, "t",
                        dict(hidden=hidden, heads=heads, kv=16, head_dim=256, layers=layers))
    assert cfg["query_pre_attn_scalar"] == scalar
