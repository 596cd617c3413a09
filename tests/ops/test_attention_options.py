"""The options of every paged attention family (issue 40): Gemma 2's score soft-capping
(`softcap`: cap * tanh(q.k * scale / cap)) and gpt-oss's learned sinks (`sinks_ptr`: a
per-head logit in the softmax's denominator only), on the CUDA-core prefill, the tensor-core
prefill and the split-K decode (one split and several, with windows): twins against plain
float64 attention, options off = the launch without them, batch invariance and chunked ==
whole with the options on, bad arguments, and the kernels (emu / CUDA) against the twins."""
import math

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL
from metrale.ops import attention as att
from metrale.ops import attention_tc as tc
from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import assert_close
from tests.helpers import Buffers
from tests.ops.test_attention import Case

CAP = 3.0   # small against these scores (|q.k| * scale ~ 3): tanh bends most of them


def ref_rows(q, k, v, qpos, h, kv, scale, window, cap, sinks):
    """float64 softmax attention with the options: q [R, H, D]; k, v [T, KV, D]."""
    g = h // kv
    out = np.zeros(q.shape)
    for r in range(q.shape[0]):
        keys = np.arange(k.shape[0])
        ok = keys <= qpos[r]
        if window:
            ok &= keys > qpos[r] - window
        for head in range(h):
            kk, vv = k[ok, head // g], v[ok, head // g]
            sc = kk @ q[r, head] * scale
            if cap:
                sc = cap * np.tanh(sc / cap)
            m = sc.max() if sinks is None else max(sc.max(), sinks[head])
            p = np.exp(sc - m)
            den = p.sum() + (0.0 if sinks is None else np.exp(sinks[head] - m))
            out[r, head] = (p / den) @ vv
    return out


def ref(c, scale, window, cap, sinks, decode):
    rows = c.n_seqs if decode else c.n_tokens
    out = np.zeros((rows, c.h, c.d))
    for s in range(c.n_seqs):
        ql, kl = (1, c.kv_lens[s]) if decode else (c.q_lens[s], c.kv_lens[s])
        if ql == 0 or kl <= 0:
            continue
        r0 = s if decode else c.qo[s]
        q = bf16_to_f32(c.qkv[r0:r0 + ql, :c.h * c.d]).astype(np.float64).reshape(ql, c.h, c.d)
        k, v = c.gathered(s)
        out[r0:r0 + ql] = ref_rows(q, k, v, np.arange(kl - ql, kl), c.h, c.kv, scale, window,
                                   cap, sinks)
    return out.reshape(rows, -1)


def run(backend, c, scale, window=0, cap=0.0, sinks=None, kind="prefill", pass_options=True):
    """kind: "prefill" (CUDA cores), "tc" (tensor cores) or "decode" (query row s of qkv
    per sequence)."""
    rows = c.n_seqs if kind == "decode" else c.n_tokens
    with Buffers(backend) as b:
        op = b.put(np.full((rows, c.h * c.d), 0x7FC0, np.uint16))   # NaN until written
        tabs = [b.put(c.qkv), b.put(c.k), b.put(c.v), b.put(c.tables),
                b.put(np.asarray(c.kv_lens, np.int32))]
        opts = {}
        if pass_options:
            opts = dict(softcap=cap, sinks_ptr=NULL if sinks is None
                        else b.put(np.asarray(sinks, np.float32)))
        s = backend.default_stream()
        if kind == "decode":
            ms = att.decode_max_splits(max(max(c.kv_lens), 1))
            ws = b.empty((att.decode_workspace_bytes(c.n_seqs, c.h, c.d, ms),), np.uint8)
            att.decode_attention(backend, s, op, *tabs, c.n_seqs, c.h, c.kv, c.d, c.bs,
                                 c.max_blocks, scale, ws, ms, window, **opts)
        else:
            launch = att.prefill_attention if kind == "prefill" else tc.prefill_attention_tc
            launch(backend, s, op, *tabs, b.put(c.qo), c.n_seqs, c.n_tokens,
                   max(max(c.q_lens), 1), c.h, c.kv, c.d, c.bs, c.max_blocks, scale, window,
                   **opts)
        return b.get(op, (rows, c.h * c.d), np.uint16)


def case(rng, kind, h=4, kv=2, d=64, bs=16):
    if kind == "decode":   # one split, several splits (256 tokens each), a window's start
        return Case(rng, [1, 1, 1, 1], [3, 300, 257, 777], h, kv, d, bs)
    return Case(rng, [7, 19, 33], [7 + 40, 19, 33 + 290], h, kv, d, bs)


def sinks_for(rng, h, big=False):
    # logits of the order of the scores (a few), one far above them (the robust max)
    s = rng.uniform(-2.0, 3.0, h)
    if big:
        s[0] = 60.0
    return s.astype(np.float32)


OPTIONS = {"softcap": (CAP, False), "sinks": (0.0, True), "both": (CAP, True)}


@pytest.mark.parametrize("window", [0, 5, 100])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["prefill", "tc", "decode"])
def test_twin_matches_float64(host, rng, kind, option, window):
    cap, with_sinks = OPTIONS[option]
    c = case(rng, kind)
    scale = 1 / math.sqrt(c.d) * 3   # scores of a few units, where caps and sinks matter
    sinks = sinks_for(rng, c.h, big=True) if with_sinks else None
    got = run(host, c, scale, window, cap, sinks, kind)
    want = ref(c, scale, window, cap, None if sinks is None else sinks.astype(np.float64),
               kind == "decode")
    # the tensor-core twin rounds P to BF16 (attention_tc.py): measured within twin_bf16
    assert_close(bf16_to_f32(got), want, "twin_bf16")
    plain = run(host, c, scale, window, kind=kind)
    assert np.max(np.abs(bf16_to_f32(got) - bf16_to_f32(plain))) > 0.05, "option inert"


@pytest.mark.parametrize("kind", ["prefill", "tc", "decode"])
def test_options_off_equal_the_launch_without_them(host, rng, kind):
    c = case(rng, kind)
    assert np.array_equal(run(host, c, 0.2, 5, kind=kind),
                          run(host, c, 0.2, 5, kind=kind, pass_options=False))


@pytest.mark.parametrize("kind", ["prefill", "tc"])
def test_batch_invariant_with_options(host, rng, kind):
    c = case(rng, kind)
    sinks = sinks_for(rng, c.h)
    batch = run(host, c, 0.3, 0, CAP, sinks, kind)
    for s in range(c.n_seqs):
        alone = run(host, c.subset(s), 0.3, 0, CAP, sinks, kind)
        assert np.array_equal(batch[c.qo[s]:c.qo[s + 1]], alone), f"sequence {s}"


def test_decode_batch_invariant_with_options(host, rng):
    c = case(rng, "decode")
    sinks = sinks_for(rng, c.h)
    batch = run(host, c, 0.3, 7, CAP, sinks, "decode")
    for s in range(c.n_seqs):
        sub = c.subset(s)
        sub.qkv = c.qkv[s:s + 1].copy()
        assert np.array_equal(run(host, sub, 0.3, 7, CAP, sinks, "decode"), batch[s:s + 1])


def test_no_visible_key_with_a_sink_gives_zero(host, rng):
    """A row whose every key is masked out would divide by the sink alone; the kernels and
    twins write 0 for it, as without a sink (the rows a window leaves empty cannot occur in
    causal attention, but a zero-length sequence in a batch can)."""
    c = Case(rng, [0, 5], [0, 5], 2, 1, 32, 16)
    got = run(host, c, 0.2, 0, 0.0, sinks_for(rng, 2), "prefill")
    assert np.all(np.isfinite(bf16_to_f32(got)))


def test_bad_options_raise_before_launch(host):
    for cap in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="softcap"):
            att.prefill_attention(host, 0, 64, 64, 64, 64, 64, 64, 64, 1, 1, 1, 2, 1, 64, 16,
                                  4, 0.1, 0, softcap=cap)
        with pytest.raises(InvalidArgument, match="softcap"):
            att.decode_attention(host, 0, 64, 64, 64, 64, 64, 64, 1, 2, 1, 64, 16, 4, 0.1,
                                 NULL, 1, softcap=cap)
    with pytest.raises(InvalidArgument, match="sinks"):
        tc.prefill_attention_tc(host, 0, 64, 64, 64, 64, 64, 64, 64, 1, 1, 1, 2, 1, 64, 16,
                                4, 0.1, 0, sinks_ptr=66)


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind,h,kv,d,bs", [
    ("prefill", 4, 2, 64, 16), ("prefill", 2, 1, 8, 5), ("prefill", 4, 2, 256, 16),
    ("prefill", 2, 2, 128, 7), ("tc", 8, 2, 64, 16), ("tc", 4, 1, 16, 3),
    ("tc", 2, 1, 256, 16), ("decode", 8, 2, 64, 16), ("decode", 4, 4, 8, 5),
    ("decode", 2, 1, 256, 16), ("decode", 16, 2, 128, 16)])
def test_gpu_matches_twin(device, host, rng, kind, h, kv, d, bs, option):
    cap, with_sinks = OPTIONS[option]
    c = case(rng, kind, h, kv, d, bs)
    sinks = sinks_for(rng, h, big=True) if with_sinks else None
    for window in (0, 9):
        g = run(device, c, 3 / math.sqrt(d), window, cap, sinks, kind)
        t = run(host, c, 3 / math.sqrt(d), window, cap, sinks, kind)
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
