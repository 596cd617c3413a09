"""rope family: table against independent float64 formulas (and values printed once by Hugging
Face transformers 5.24's ROPE_INIT_FUNCTIONS), the twin against a float64 rotation, and the
GPU kernel against the twin."""
import math
from types import SimpleNamespace as NS

import numpy as np
import pytest

from metrale import MetraleError
from metrale.errors import InvalidArgument, KernelError
from metrale.gpu_runtime import NULL
from metrale.ops import rope
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


# ------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------
def ref_inv_freq_default(d, theta):
    return [theta ** (-(2.0 * j) / d) for j in range(d // 2)]


def ref_inv_freq_llama3(d, theta, factor, low, high, old):
    """Llama 3.1 scaling, written from its definition one frequency at a time."""
    out = []
    for f in ref_inv_freq_default(d, theta):
        wl = 2 * math.pi / f
        if wl < old / high:          # high frequency: unchanged
            out.append(f)
        elif wl > old / low:         # low frequency: interpolated by factor
            out.append(f / factor)
        else:                        # smooth blend in between
            a = (old / wl - low) / (high - low)
            out.append((1 - a) * f / factor + a * f)
    return out


def ref_inv_freq_yarn(d, theta, factor, old, beta_fast=32, beta_slow=1):
    """YaRN (NTK-by-parts): ramp between interpolation and extrapolation per dimension."""
    def dim_for(rot):
        return d * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))
    lo = max(math.floor(dim_for(beta_fast)), 0)
    hi = min(math.ceil(dim_for(beta_slow)), d - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for j, f in enumerate(ref_inv_freq_default(d, theta)):
        ramp = min(max((j - lo) / (hi - lo), 0.0), 1.0)   # 0: keep f, 1: f / factor
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def ref_table(inv, max_pos, attn=1.0):
    t = np.empty((max_pos, 2 * len(inv)))
    for p in range(max_pos):
        for j, f in enumerate(inv):
            t[p, j] = math.cos(p * f) * attn
            t[p, len(inv) + j] = math.sin(p * f) * attn
    return t


SCALINGS = {
    "default": (10000.0, None, lambda d: (ref_inv_freq_default(d, 10000.0), 1.0)),
    "default_obj": (1e6, NS(rope_type="default"),
                    lambda d: (ref_inv_freq_default(d, 1e6), 1.0)),
    "linear": (10000.0, NS(rope_type="linear", factor=4.0),
               lambda d: ([f / 4.0 for f in ref_inv_freq_default(d, 10000.0)], 1.0)),
    "llama3": (500000.0, NS(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192),
               lambda d: (ref_inv_freq_llama3(d, 500000.0, 8.0, 1.0, 4.0, 8192), 1.0)),
    "yarn": (1e6, NS(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768,
                     beta_fast=32.0, beta_slow=1.0, attention_factor=None),
             lambda d: (ref_inv_freq_yarn(d, 1e6, 4.0, 32768), 0.1 * math.log(4.0) + 1)),
    "yarn_attn": (10000.0, NS(rope_type="yarn", factor=2.0,
                              original_max_position_embeddings=2048, beta_fast=None,
                              beta_slow=None, attention_factor=1.3),
                  lambda d: (ref_inv_freq_yarn(d, 10000.0, 2.0, 2048), 1.3)),
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_table_matches_float64_formula(name, head_dim):
    theta, scaling, ref = SCALINGS[name]
    inv, attn = ref(head_dim)
    got = rope.rope_table(head_dim, 300, theta, scaling)
    assert got.dtype == np.float32 and got.shape == (300, head_dim)
    want = ref_table(inv, 300, attn)
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=0, atol=2e-7 * attn)


# inv_freq[[0, 5, 11, 17, 23, 31]] and attention_factor for head_dim 64, printed by
# transformers 5.24 ROPE_INIT_FUNCTIONS (float32 torch math, hence rtol 1e-6).
HF_VALUES = {
    "linear": (1.0, [0.25, 0.05928434059023857, 0.010542412288486958, 0.0018747355788946152,
                     0.00033338036155328155, 3.333803761051968e-05]),
    "llama3": (1.0, [1.0, 0.12868738174438477, 0.010989529080688953, 0.0001785077911335975,
                     1.0017868589784484e-05, 3.76732259610435e-07]),
    "yarn": (1.138629436111989, [1.0, 0.11547820270061493, 0.00865964312106371,
                                 0.00032469083089381456, 1.2174188668723218e-05,
                                 3.8498163235090033e-07]),
    "yarn_attn": (1.3, [1.0, 0.23713736236095428, 0.03730392083525658, 0.004903154447674751,
                        0.0006667607231065631, 6.667607522103935e-05]),
}


@pytest.mark.parametrize("name", list(HF_VALUES))
def test_inv_freq_matches_transformers_spot_values(name):
    theta, scaling, _ = SCALINGS[name]
    inv, attn = rope.rope_inv_freq(64, theta, scaling)
    want_attn, want = HF_VALUES[name]
    assert attn == pytest.approx(want_attn, rel=1e-12)
    np.testing.assert_allclose(inv[[0, 5, 11, 17, 23, 31]], want, rtol=1e-6)


def test_table_rejects_bad_scaling():
    with pytest.raises(InvalidArgument, match="rope_type"):
        rope.rope_table(64, 10, 10000.0, NS(rope_type="dynamic-nonsense"))
    with pytest.raises(InvalidArgument, match="head_dim"):
        rope.rope_table(63, 10, 10000.0, None)
    with pytest.raises(InvalidArgument, match="max_positions"):
        rope.rope_table(64, 0, 10000.0, None)


# ------------------------------------------------------------------------------------------
# kernel
# ------------------------------------------------------------------------------------------
def run_rope(backend, qkv_bits, positions, table, h, kv, d, q_norm=None, k_norm=None,
             eps=1e-6):
    n = qkv_bits.shape[0]
    with Buffers(backend) as b:
        qp = b.put(qkv_bits)
        pp = b.put(np.asarray(positions, np.int32))
        tp = b.put(np.ascontiguousarray(table, np.float32))
        qn = b.put(q_norm) if q_norm is not None else NULL
        kn = b.put(k_norm) if k_norm is not None else NULL
        rope.apply_rope(backend, backend.default_stream(), qp, pp, tp, n, h, kv, d,
                        table.shape[0], qn, kn, eps)
        return b.get(qp, qkv_bits.shape, np.uint16)


def ref_rope(qkv_bits, positions, table, h, kv, d, q_norm=None, k_norm=None, eps=1e-6):
    """float64 rotation of the q and k heads; the q/k norm output is rounded to bf16 (the
    documented single rounding), the final result is returned unrounded."""
    n = qkv_bits.shape[0]
    x = bf16_to_f32(qkv_bits).astype(np.float64).reshape(n, h + 2 * kv, d)
    out = x.copy()
    for t in range(n):
        c = table[positions[t], :d // 2].astype(np.float64)
        s = table[positions[t], d // 2:].astype(np.float64)
        for head in range(h + kv):
            v = x[t, head].copy()
            w = q_norm if head < h else k_norm
            if w is not None:
                v = v / np.sqrt(np.mean(v * v) + eps) * bf16_to_f32(w).astype(np.float64)
                v = bf16_to_f32(f32_to_bf16(v.astype(np.float32))).astype(np.float64)
            x1, x2 = v[:d // 2], v[d // 2:]
            out[t, head] = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s])
    return out.reshape(n, -1)


def rand_bits(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("n_tokens", [1, 7, 19, 111])
@pytest.mark.parametrize("h,kv,d", [(4, 2, 64), (2, 1, 128), (3, 3, 32), (4, 1, 6)])
def test_twin_matches_float64(host, rng, n_tokens, h, kv, d):
    table = rope.rope_table(d, 4096, 10000.0, None)
    qkv = rand_bits(rng, (n_tokens, (h + 2 * kv) * d))
    pos = rng.integers(0, 4096, n_tokens).astype(np.int32)
    got = run_rope(host, qkv, pos, table, h, kv, d)
    want = ref_rope(qkv, pos, table, h, kv, d)
    assert_close(bf16_to_f32(got), want, "twin_bf16")
    # v heads untouched, bit for bit
    assert np.array_equal(got[:, (h + kv) * d:], qkv[:, (h + kv) * d:])


@pytest.mark.parametrize("n_tokens", [1, 19])
def test_twin_qk_norm_matches_float64(host, rng, n_tokens):
    h, kv, d = 4, 2, 128
    table = rope.rope_table(d, 64, 1e6, None)
    qkv = rand_bits(rng, (n_tokens, (h + 2 * kv) * d), scale=3.0)
    qn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32))
    kn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32))
    pos = rng.integers(0, 64, n_tokens).astype(np.int32)
    got = run_rope(host, qkv, pos, table, h, kv, d, qn, kn, 1e-6)
    want = ref_rope(qkv, pos, table, h, kv, d, qn, kn, 1e-6)
    assert_close(bf16_to_f32(got), want, "twin_bf16")
    # only q normed: k heads equal plain rope
    got_q = run_rope(host, qkv, pos, table, h, kv, d, qn, None)
    want_q = ref_rope(qkv, pos, table, h, kv, d, qn, None)
    assert_close(bf16_to_f32(got_q), want_q, "twin_bf16")


def test_yarn_attention_factor_scales_rotation(host, rng):
    d = 64
    scaling = NS(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    table = rope.rope_table(d, 512, 10000.0, scaling)
    qkv = rand_bits(rng, (5, 3 * d))
    pos = np.array([0, 1, 127, 300, 511], np.int32)
    got = run_rope(host, qkv, pos, table, 1, 1, d)
    assert_close(bf16_to_f32(got), ref_rope(qkv, pos, table, 1, 1, d), "twin_bf16")
    # position 0: pure scaling by the attention factor
    af = 0.1 * math.log(4.0) + 1
    assert_close(bf16_to_f32(got[0, :2 * d]), bf16_to_f32(qkv[0, :2 * d]) * af, "twin_bf16")


def test_position_outside_table_raises_in_twin(host, rng):
    table = rope.rope_table(32, 16, 10000.0, None)
    qkv = rand_bits(rng, (3, 3 * 32))
    with pytest.raises(KernelError, match="positions"):
        run_rope(host, qkv, [0, 16, 2], table, 1, 1, 32)
    with pytest.raises(KernelError, match="positions"):
        run_rope(host, qkv, [0, -1, 2], table, 1, 1, 32)


def test_bad_arguments_raise_before_launch(host):
    ok = dict(n_tokens=4, num_heads=4, num_kv_heads=2, head_dim=64, max_positions=16)

    def call(**kw):
        a = {**ok, **kw}
        rope.apply_rope(host, 0, 64, 64, 64, a["n_tokens"], a["num_heads"],
                        a["num_kv_heads"], a["head_dim"], a["max_positions"])

    for kw, msg in [({"n_tokens": 0}, "n_tokens"), ({"num_kv_heads": 3}, "multiple"),
                    ({"num_heads": 0}, "num_heads"), ({"head_dim": 63}, "head_dim"),
                    ({"head_dim": 258}, "head_dim"), ({"max_positions": 0}, "max_positions")]:
        with pytest.raises(InvalidArgument, match=msg):
            call(**kw)
    with pytest.raises(MetraleError, match="NULL"):
        rope.apply_rope(host, 0, NULL, 64, 64, 4, 4, 2, 64, 16)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens,h,kv,d,norm", [
    (1, 32, 8, 128, False), (111, 32, 8, 128, False), (19, 28, 4, 128, False),
    (37, 32, 8, 128, True), (7, 16, 8, 128, True), (5, 4, 1, 64, False), (9, 3, 3, 6, True),
    (3, 2, 2, 256, True)])
def test_gpu_matches_twin(device, host, rng, n_tokens, h, kv, d, norm):
    scaling = NS(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=8192)
    table = rope.rope_table(d, 4096, 500000.0, scaling)
    qkv = rand_bits(rng, (n_tokens, (h + 2 * kv) * d), scale=2.0)
    pos = rng.integers(0, 4096, n_tokens).astype(np.int32)
    qn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    kn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    g = run_rope(device, qkv, pos, table, h, kv, d, qn, kn)
    t = run_rope(host, qkv, pos, table, h, kv, d, qn, kn)
    assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
    assert np.array_equal(g[:, (h + kv) * d:], qkv[:, (h + kv) * d:])


# ------------------------------------------------------------------------------------------
# rope_write_kv: apply_rope and write_kv in one launch
# ------------------------------------------------------------------------------------------
SENTINEL = 0x7E7E


def run_rope_write_kv(backend, qkv_bits, positions, table, slots, num_blocks, bs, h, kv, d,
                      q_norm=None, k_norm=None, fused=True):
    """(qkv after, k_cache, v_cache [num_blocks*bs, kv*d]) of rope_write_kv, or of apply_rope
    then kv_cache.write_kv when not `fused`."""
    from metrale.ops import kv_cache
    n = qkv_bits.shape[0]
    shape = (num_blocks * bs, kv * d)
    with Buffers(backend) as b:
        qp, pp = b.put(qkv_bits), b.put(np.asarray(positions, np.int32))
        tp = b.put(np.ascontiguousarray(table, np.float32))
        kp = b.put(np.full(shape, SENTINEL, np.uint16))
        vp = b.put(np.full(shape, SENTINEL, np.uint16))
        sp = b.put(np.asarray(slots, np.int32))
        qn = b.put(q_norm) if q_norm is not None else NULL
        kn = b.put(k_norm) if k_norm is not None else NULL
        s = backend.default_stream()
        if fused:
            rope.rope_write_kv(backend, s, qp, pp, tp, kp, vp, sp, n, h, kv, d, table.shape[0],
                               qn, kn, 1e-6)
        else:
            rope.apply_rope(backend, s, qp, pp, tp, n, h, kv, d, table.shape[0], qn, kn, 1e-6)
            kv_cache.write_kv(backend, s, qp, kp, vp, sp, n, h, kv, d)
        return (b.get(qp, qkv_bits.shape, np.uint16), b.get(kp, shape, np.uint16),
                b.get(vp, shape, np.uint16))


def kv_case(rng, n, h, kv, d, bs, max_pos=4096, pad_every=3):
    num_blocks = -(-n // bs) + 2
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int32)
    if pad_every and n > pad_every:
        slots[::pad_every] = -1
    qkv = rand_bits(rng, (n, (h + 2 * kv) * d), scale=2.0)
    pos = rng.integers(0, max_pos, n).astype(np.int32)
    return qkv, pos, slots, num_blocks


@pytest.mark.parametrize("n_tokens", [1, 7, 19])
@pytest.mark.parametrize("h,kv,d,norm", [(4, 2, 64, False), (3, 3, 32, True), (4, 1, 6, True)])
def test_rope_write_kv_twin_matches_float64(host, rng, n_tokens, h, kv, d, norm):
    table = rope.rope_table(d, 4096, 10000.0, None)
    qkv, pos, slots, nb = kv_case(rng, n_tokens, h, kv, d, 5)
    qn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    kn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    got, kc, vc = run_rope_write_kv(host, qkv, pos, table, slots, nb, 5, h, kv, d, qn, kn)
    assert_close(bf16_to_f32(got), ref_rope(qkv, pos, table, h, kv, d, qn, kn), "twin_bf16")
    want_k = np.full_like(kc, SENTINEL)
    want_v = np.full_like(vc, SENTINEL)
    for t, s in enumerate(slots):
        if s >= 0:                      # the rotated k heads and the untouched v heads
            want_k[s] = got[t, h * d:(h + kv) * d]
            want_v[s] = qkv[t, (h + kv) * d:]
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)


def test_rope_write_kv_bad_arguments(host):
    with pytest.raises(InvalidArgument, match="rope_write_kv: k_cache is NULL"):
        rope.rope_write_kv(host, 0, 64, 64, 64, NULL, 256, 64, 4, 4, 2, 64, 16)
    with pytest.raises(InvalidArgument, match="rope_write_kv: qkv pointer .* 4-byte aligned"):
        rope.rope_write_kv(host, 0, 66, 64, 64, 256, 256, 64, 4, 4, 2, 64, 16)
    with pytest.raises(InvalidArgument, match="rope_write_kv: head_dim"):
        rope.rope_write_kv(host, 0, 64, 64, 64, 256, 256, 64, 4, 4, 2, 63, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens,h,kv,d,norm", [
    (1, 32, 8, 128, False), (111, 32, 8, 128, False), (19, 28, 4, 128, False),
    (7, 16, 8, 128, True), (9, 3, 3, 6, True), (3, 2, 2, 256, True)])
def test_gpu_rope_write_kv_equals_the_two_kernels(device, host, rng, n_tokens, h, kv, d, norm):
    """Bit for bit the launches it replaces (apply_rope, then write_kv) on the same device,
    and the twin within the rope tolerance."""
    table = rope.rope_table(d, 4096, 500000.0, None)
    qkv, pos, slots, nb = kv_case(rng, n_tokens, h, kv, d, 16)
    qn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    kn = f32_to_bf16(rng.uniform(0.5, 1.5, d).astype(np.float32)) if norm else None
    args = (qkv, pos, table, slots, nb, 16, h, kv, d, qn, kn)
    fused = run_rope_write_kv(device, *args)
    apart = run_rope_write_kv(device, *args, fused=False)
    for a, b in zip(fused, apart):
        assert np.array_equal(a, b)
    for a, b in zip(fused, run_rope_write_kv(host, *args)):
        assert_close(bf16_to_f32(a), bf16_to_f32(b), "gpu_vs_twin_bf16")


@pytest.mark.gpu
def test_gpu_rope_write_kv_position_outside_the_table(device, rng):
    """The kernel leaves such a token's qkv row as it is and caches its k unrotated (as
    apply_rope + write_kv do); the twin raises instead (callers check positions)."""
    h, kv, d = 4, 2, 64
    table = rope.rope_table(d, 16, 10000.0, None)
    qkv, _, slots, nb = kv_case(rng, 3, h, kv, d, 16, pad_every=0)
    pos = np.array([3, 16, -1], np.int32)
    got, kc, vc = run_rope_write_kv(device, qkv, pos, table, slots, nb, 16, h, kv, d)
    assert np.array_equal(got[1:], qkv[1:])
    for t in (1, 2):
        assert np.array_equal(kc[slots[t]], qkv[t, h * d:(h + kv) * d])
        assert np.array_equal(vc[slots[t]], qkv[t, (h + kv) * d:])
