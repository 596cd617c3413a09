"""GGUF weights kept at their stored bytes (the default load) against the same file
dequantized at load (`gguf_dequantize=True`): logits bit for bit through the pointer API
(prefill, decode, decode_batch of several sequences, chunked prefill, verify) and the tensor
API, for the committed fixtures and for files written here in every packed type (mixed
fused groups, tied K-quant embeddings: tests/model/gguf_files.py); the weights held are the
planes' bytes and about the file's tensor bytes."""
from __future__ import annotations

import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.formats import open_source
from metrale.formats.gguf.file import GGUFFile
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend, backend
from metrale.model_engine.layers import decode_fusable
from metrale.model_engine.linear import GgufLinear
from tests.conftest import emu_available
from tests.formats.gguf_util import GGUF_FIXTURES
from tests.model.common import logits_rows
from tests.model.gguf_files import by_part, one_type, write_model

K_MIXED = dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K",
               ffn_gate="Q5_K", ffn_up="Q4_K", ffn_down="Q6_K", token_embd="Q4_K",
               output="Q6_K")
# name -> (fixture it is written from, types, write_model options); None: the fixture itself
FILES = {
    "llama": None, "qwen2": None, "qwen3": None,
    **{f"llama-{t}": ("llama", one_type(t), {}) for t in
       ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")},
    **{f"wide-{t}": ("llama", one_type(t), dict(wide=True, tied=True)) for t in
       ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")},
    # q|k Q4_K beside v Q6_K, gate Q5_K beside up Q4_K (a Q4_K_M file's mix), untied
    "wide-mixed": ("llama", by_part(**K_MIXED), dict(wide=True, tied=False)),
    # qkv biases, three runs in q|k|v, IQ4_XS / Q3_K linears, a tied Q6_K embedding
    "qwen2-wide-mixed": ("qwen2", by_part(attn_q="Q4_K", attn_k="Q6_K", attn_v="Q4_K",
                                          attn_output="Q5_K", ffn_gate="IQ4_XS",
                                          ffn_up="Q4_K", ffn_down="Q3_K",
                                          token_embd="Q6_K"), dict(wide=True, tied=True)),
    "qwen3-wide-mixed": ("qwen3", by_part(**K_MIXED), dict(wide=True, tied=True)),
}
EMU = pytest.param("emu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not emu_available(), reason="no C++ compiler")])


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    made = {}

    def path(name):
        if FILES[name] is None:
            return GGUF_FIXTURES / f"{name}.gguf"
        if name not in made:
            base, types, opts = FILES[name]
            made[name] = write_model(tmp_path_factory.mktemp("gguf") / f"{name}.gguf", base,
                                     types, **opts)
        return made[name]
    return path


def load(path, be=None, **options):
    return metrale.load(path, be or HostBackend(), progress=False, **options)


def pointer_rows(m) -> list[np.ndarray]:
    """Logits (as uint32 / uint16 bits) of every forward path of the pointer API."""
    V = m.vocab_size()
    ids = [(7 * i + 3) % V for i in range(40)]
    s = m.default_stream()

    def rows(ptr, n=1):
        r = logits_rows(m, ptr, n)
        return r.view(np.uint32).copy()
    out = []
    seq = m.alloc_sequence()
    out.append(rows(m.prefill(ids[:13], seq, s)))
    out += [rows(m.decode(t, seq, s)) for t in ids[13:16]]
    seqs = []
    for n in (1, 5, 17):
        q = m.alloc_sequence()
        m.prefill(ids[n:2 * n], q, s)
        seqs.append(q)
    out.append(rows(m.decode_batch([ids[30], ids[31], ids[32]], seqs, s), 3))
    chunked = m.alloc_sequence()
    for a, b in ((0, 4), (4, 11), (11, 19)):
        p = m.prefill_chunk(ids[:19], chunked, a, b - a, b == 19, s)
    out.append(rows(p))
    out.append(np.array(m.decode_verify([ids[19], ids[20], ids[21]], chunked, s)))
    return out


def packed_linears(m) -> list[GgufLinear]:
    W = m._weights
    lins = [W.embed_tokens, W.lm_head] + [x for L in W.layers for x in
                                          (L.qkv, L.o_proj, L.gate_up, L.down_proj)]
    return [x for x in lins if isinstance(x, GgufLinear)]


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", list(FILES))
def test_pointer_api_is_bit_equal_to_dequantizing_at_load(gguf_file, name, device_name):
    path = gguf_file(name)
    packed = load(path, backend(device_name))
    ref = load(path, backend(device_name), gguf_dequantize=True)
    assert packed_linears(packed) and not packed_linears(ref)
    # GGUF linears decode unfused; the BF16 model of the same file fuses (gemm_fused)
    assert not decode_fusable(packed, 1) and decode_fusable(ref, 1)
    for i, (a, b) in enumerate(zip(pointer_rows(packed), pointer_rows(ref))):
        assert np.array_equal(a, b), f"{name}: path {i} differs"
    packed.teardown()
    ref.teardown()


@pytest.mark.parametrize("name", ["llama", "wide-mixed", "qwen2-wide-mixed", "wide-Q2_K"])
def test_fp32_logits_are_bit_equal(gguf_file, name):
    """The lm_head's FP32 output (gemm_gguf out_fp32), a tied K-quant one included."""
    path = gguf_file(name)
    a, b = (load(path, fp32_logits=True, **o) for o in ({}, {"gguf_dequantize": True}))
    for x, y in zip(pointer_rows(a), pointer_rows(b)):
        assert np.array_equal(x, y), name


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-IQ4_NL", "wide-Q6_K",
                                  "qwen2-wide-mixed"])
def test_tensor_api_is_bit_equal_to_dequantizing_at_load(gguf_file, name):
    """embed (the packed table's rows dequantized), prefill_all_logits, decode."""
    path = gguf_file(name)
    outs = []
    for opts in ({}, {"gguf_dequantize": True}):
        gm = metrale.load_generative(path, HostBackend(), progress=False, **opts)
        ids = (np.arange(24, dtype=np.int32).reshape(1, 24) * 11 + 2) % gm.metadata().vocab_size
        emb = to_numpy(gm.embed(ids))
        with gm.create_kv_cache(CacheConfig(max_seq_len=32)) as cache:
            rows = to_numpy(gm.prefill_all_logits(gm.embed(ids[:, :20]), cache, range(20)))
            dec = to_numpy(gm.decode(gm.embed(ids[:, 20:21]), cache))
        outs.append([emb, rows, dec])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), name


@pytest.mark.parametrize("name", list(FILES))
def test_weights_held_are_the_planes_and_the_files_bytes(gguf_file, name):
    """model.weight_bytes() = the bytes allocated for the weights = the planes' bytes of
    what stays packed + BF16 of the rest (what the memory plan counted), within 5% of the
    file's tensor bytes (norms F32 -> BF16 take less, q's row padding more)."""
    path = gguf_file(name)
    be = HostBackend()
    m = load(path, be)
    W = m._weights
    assert m.weight_bytes() == W.nbytes == sum(be.find_allocation(p)[1] for p in W._owned)
    src = open_source(path)
    planes = sum(x.nbytes for x in {id(x): x for x in packed_linears(m)}.values())
    assert planes == sum(src.planes_nbytes(n) for n in src.tensor_names()
                         if any(n in s for s in _packed_names(m, src)))
    file_bytes = sum(t.nbytes for t in GGUFFile(path).tensors.values())
    ratio = m.weight_bytes() / file_bytes
    assert 0.95 <= ratio <= 1.05, f"{name}: held {m.weight_bytes()} of {file_bytes} ({ratio})"
    assert m.weight_bytes() < load(path, gguf_dequantize=True).weight_bytes()


def _packed_names(m, src) -> list[set[str]]:
    """The tensor names of each fused group held packed (gguf_weights.weight_groups)."""
    from metrale.model_engine.gguf_weights import packed_runs, weight_groups
    return [set(g) for g in weight_groups(m._meta, set(src.tensor_names()))
            if packed_runs(src, g)]


def test_the_fixtures_ratios(gguf_file):
    """The bytes-held ratios the report quotes (the committed fixtures)."""
    got = {}
    for name in ("llama", "qwen2", "qwen3"):
        path = gguf_file(name)
        got[name] = round(load(path).weight_bytes() /
                          sum(t.nbytes for t in GGUFFile(path).tensors.values()), 3)
    assert got == {"llama": 0.996, "qwen2": 1.030, "qwen3": 0.992}


def test_the_memory_plan_counts_the_bytes_held(monkeypatch):
    """The plan sizes the weights as held (before anything is allocated): a device too
    small names the planes' bytes, and the BF16 bytes when dequantizing at load."""
    from metrale.errors import OutOfMemory
    from metrale.gpu_runtime.host import HostBackend as Host
    path = GGUF_FIXTURES / "llama.gguf"
    held, bf16 = load(path).weight_bytes(), load(path, gguf_dequantize=True).weight_bytes()
    monkeypatch.setattr(Host, "free_memory", lambda self: 1 << 16)
    for opts, want in (({}, held), ({"gguf_dequantize": True}, bf16)):
        with pytest.raises(OutOfMemory, match=f"the weights alone need {want} bytes"):
            load(path, **opts)
