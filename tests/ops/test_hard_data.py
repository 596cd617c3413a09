"""Data that breaks a wrong initial value or a careless vector path, fed to the kernels:
argmax rows whose every logit is negative (a running maximum started at 0 answers index 0),
attention rows whose every score is far below zero (a running max started at 0 underflows
every exp and divides by zero), outputs at an odd 2-byte offset (a 128-bit store there is a
misaligned-address fault; on the emulator the alignment check is on), and a launch over a
kernel's __launch_bounds__."""
from __future__ import annotations

import math

import numpy as np
import pytest

from metrale.errors import KernelError
from metrale.ops import activation, argmax, attention, attention_tc, elementwise, gemm_tc, rmsnorm
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers
from tests.ops.test_attention import Case, ref_decode, ref_prefill, run_decode, run_prefill


def checked(device):
    """The device; on the emulator with every 2/4/8/16-byte access's alignment checked."""
    if device.name == "emu":
        from metrale.gpu_runtime.emu import EmuBackend
        return EmuBackend(checks="align")
    return device


# ------------------------------------------------------------------ argmax
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [7, 1025, 32000])
def test_gpu_argmax_of_all_negative_rows(device, host, rng, vocab):
    rows = -(1.0 + rng.permutation(vocab * 3).reshape(3, vocab).astype(np.float32))
    rows[2] *= 1e20          # still far above the -1e30 start value
    bf_rows = bf16_to_f32(f32_to_bf16(rows))
    want = [int(np.argmax(r)) for r in rows]
    with Buffers(device) as b:
        out = b.empty((3,), np.int32)
        lp = b.put(rows)
        argmax.argmax_fp32(device, device.default_stream(), lp, out, 3, vocab)
        assert list(b.get(out, (3,), np.int32)) == want
        lb = b.put(f32_to_bf16(rows))
        argmax.argmax_bf16_batch(device, device.default_stream(), lb, out, 3, vocab)
        got = list(b.get(out, (3,), np.int32))
    assert [float(bf_rows[i, g]) for i, g in enumerate(got)] == list(bf_rows.max(axis=1))
    with Buffers(host) as b:
        out = b.empty((3,), np.int32)
        argmax.argmax_bf16_batch(host, 0, b.put(f32_to_bf16(rows)), out, 3, vocab)
        assert list(b.get(out, (3,), np.int32)) == got


# ------------------------------------------------------------------ attention
def very_negative(c, rng):
    """Queries +8 and keys -8 + noise: every score is around -8 * 8 * D * scale (far below
    exp's range), while their differences, which softmax depends on, stay ordinary."""
    q_cols = c.h * c.d
    c.qkv[:, :q_cols] = f32_to_bf16(np.full((c.n_tokens, q_cols), 8.0, np.float32))
    c.k = f32_to_bf16((-8.0 + 0.5 * rng.standard_normal(c.k.shape)).astype(np.float32))
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", [(4, 1, 64, 16), (2, 2, 128, 16)])
def test_gpu_attention_with_every_score_very_negative(device, host, rng, h, kv, d, bs):
    scale = 1 / math.sqrt(d)
    c = very_negative(Case(rng, [5, 1, 19], [5 + 300, 1, 19 + 40], h, kv, d, bs), rng)
    want = ref_prefill(c, scale)
    for be_run in (run_prefill, lambda be, cc, s: _run_tc(be, cc, s)):
        got = bf16_to_f32(be_run(device, c, scale))
        assert np.all(np.isfinite(got))
        assert_close(got, want, "twin_bf16", "prefill")
    dc = very_negative(Case(rng, [1, 1, 1], [300, 1, 700], h, kv, d, bs), rng)
    got = bf16_to_f32(run_decode(device, dc, scale))
    assert np.all(np.isfinite(got))
    assert_close(got, ref_decode(dc, scale), "twin_bf16", "decode")
    assert_close(got, bf16_to_f32(run_decode(host, dc, scale)), "gpu_vs_twin_bf16", "decode")


def _run_tc(backend, c, scale):
    if c.d not in attention_tc.TC_HEAD_DIMS:
        return run_prefill(backend, c, scale)
    from tests.ops.test_attention_tc import run
    return run(backend, c, scale)


# ------------------------------------------------------------------ odd 2-byte offsets
@pytest.mark.gpu
def test_gpu_outputs_at_an_odd_two_byte_offset(device, host, rng):
    """Every bf16-writing kernel whose fast path stores 128 bits, with its output one
    element into an allocation: the result must equal the aligned run's, and on the
    emulator no access may be misaligned."""
    be = checked(device)
    rows, hid, inter, n = 3, 256, 192, 40
    x = f32_to_bf16(rng.standard_normal((rows, hid)).astype(np.float32))
    w = f32_to_bf16(1 + 0.1 * rng.standard_normal(hid).astype(np.float32))
    gu = f32_to_bf16(rng.standard_normal((rows, 2 * inter)).astype(np.float32))
    wm = f32_to_bf16(rng.standard_normal((n, hid)).astype(np.float32))
    cases = {
        "rmsnorm": (rows * hid, lambda bk, b, o: rmsnorm.rmsnorm(
            bk, 0, o, b.put(x), b.put(w), rows, hid, 1e-5)),
        "act_mul": (rows * inter, lambda bk, b, o: activation.act_mul(
            bk, 0, o, b.put(gu), rows, inter)),
        "gemm_tc": (rows * n, lambda bk, b, o: gemm_tc.gemm_tc(
            bk, 0, o, b.put(x), b.put(wm), rows, n, hid)),
        "add_inplace": (rows * hid, lambda bk, b, o: (
            bk.copy_h2d(x, o), elementwise.add_inplace(bk, 0, o, b.put(x), rows * hid))),
    }
    for name, (count, fn) in cases.items():
        results = []
        for backend, offset in ((host, 0), (be, 0), (be, 1)):
            with Buffers(backend) as b:
                base = b.empty((count + 8,), np.uint16)
                out = base.offset(2 * offset)
                fn(backend, b, out)
                results.append(b.get(out, (count,), np.uint16))
        assert np.array_equal(results[1], results[2]), name
        assert_close(bf16_to_f32(results[2]), bf16_to_f32(results[0]), "gpu_vs_twin_bf16", name)


# ------------------------------------------------------------------ launch bounds
@pytest.mark.gpu
def test_emu_refuses_a_block_over_a_project_kernels_bound(device):
    if device.name != "emu":
        pytest.skip("the GPU refuses it itself (too many resources requested)")
    k = device.kernel(gemm_tc.MODULE, "gemm_tc_bf16_16x16")
    with Buffers(device) as b:
        p = b.empty((64,), np.uint16)
        args = (p, p, p, np.int32(1), np.int32(1), np.int32(8))
        with pytest.raises(KernelError, match=r"gemm_tc.gemm_tc_bf16_16x16 \(gemm_tc.cu:\d+\): "
                           r"block of 128 threads is over its __launch_bounds__\(64\)"):
            device.launch(k, (1, 1), (128,), 0, 0, args)
