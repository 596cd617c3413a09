"""conv1d family: time-major 1-D convolution (Whisper stem), bias + optional exact GELU."""
import math

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import conv1d as cv
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run(backend, x, w, b, stride, padding, gelu, misalign=False):
    length, c_in = x.shape
    c_out, k, _ = w.shape
    l_out = cv.output_length(length, k, stride, padding)
    with Buffers(backend) as buf:
        if misalign:  # x at a 2-byte offset: forces the scalar path
            xp = buf.put(np.concatenate([np.zeros(1, np.uint16), x.reshape(-1)])).offset(2)
        else:
            xp = buf.put(x)
        wp, bp = buf.put(w), buf.put(b)
        op = buf.empty((l_out, c_out), np.uint16)
        cv.conv1d(backend, backend.default_stream(), op, xp, wp, bp, c_in, c_out, length, k,
                  stride, padding, gelu)
        return buf.get(op, (l_out, c_out), np.uint16)


def reference(x, w, b, stride, padding, gelu):
    """float64 direct loop over taps (HF's Conv1d on [c_in, length], transposed)."""
    xf, wf, bf = (bf16_to_f32(a).astype(np.float64) for a in (x, w, b))
    length, c_in = xf.shape
    c_out, k, _ = wf.shape
    l_out = (length + 2 * padding - k) // stride + 1
    y = np.tile(bf, (l_out, 1))
    for t in range(l_out):
        for kk in range(k):
            src = t * stride - padding + kk
            if 0 <= src < length:
                y[t] += wf[:, kk, :] @ xf[src]
    if gelu:
        y = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    return y


def test_entry_points_exist():
    assert {"conv1d_v8", "conv1d_v1"} <= set(kernel_source.entry_points(cv.MODULE))


@pytest.mark.parametrize("length,c_in,c_out,stride", [(10, 8, 16, 1), (11, 8, 16, 2),
                                                      (37, 5, 70, 1), (64, 24, 66, 2),
                                                      (1, 3, 4, 1), (2, 8, 8, 2)])
@pytest.mark.parametrize("gelu", [False, True])
def test_twin_matches_float64(host, rng, length, c_in, c_out, stride, gelu):
    x, w, b = rand_bf16(rng, (length, c_in)), rand_bf16(rng, (c_out, 3, c_in), 0.3), \
        rand_bf16(rng, (c_out,), 0.1)
    got = run(host, x, w, b, stride, 1, gelu)
    assert_close(bf16_to_f32(got), reference(x, w, b, stride, 1, gelu), "twin_bf16")


def test_output_length_whisper_stem():
    assert cv.output_length(3000, 3, 1, 1) == 3000
    assert cv.output_length(3000, 3, 2, 1) == 1500
    assert cv.output_length(201, 3, 2, 1) == 101


def test_hf_weight_permutation(host, rng):
    hf = rand_bf16(rng, (6, 4, 3))  # [c_out, c_in, k]
    tm = cv.hf_weight_to_tap_major(hf)
    assert tm.shape == (6, 3, 4) and tm[2, 1, 3] == hf[2, 3, 1]


def test_misaligned_scalar_path_equals_vector(host, rng):
    x, w, b = rand_bf16(rng, (20, 16)), rand_bf16(rng, (8, 3, 16), 0.3), rand_bf16(rng, (8,))
    assert np.array_equal(run(host, x, w, b, 2, 1, True), run(host, x, w, b, 2, 1, True,
                                                               misalign=True))


def test_bad_arguments_raise(host):
    with pytest.raises(InvalidArgument, match="c_in"):
        cv.conv1d(host, 0, 16, 16, 16, 16, 0, 4, 10, 3, 1, 1, False)
    with pytest.raises(InvalidArgument, match="kernel_size"):
        cv.conv1d(host, 0, 16, 16, 16, 16, 4, 4, 1, 5, 1, 0, False)
    with pytest.raises(InvalidArgument, match="bias_ptr"):
        cv.conv1d(host, 0, 16, 16, 16, 0, 4, 4, 10, 3, 1, 1, False)
    with pytest.raises(InvalidArgument, match="padding"):
        cv.conv1d(host, 0, 16, 16, 16, 16, 4, 4, 10, 3, 1, -1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("length,c_in,c_out,stride", [(3000, 80, 384, 1), (3000, 384, 384, 2),
                                                      (37, 5, 70, 1), (201, 24, 66, 2)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gpu_matches_twin(device, host, rng, length, c_in, c_out, stride, gelu):
    x, w, b = rand_bf16(rng, (length, c_in)), rand_bf16(rng, (c_out, 3, c_in), 0.1), \
        rand_bf16(rng, (c_out,), 0.1)
    g = run(device, x, w, b, stride, 1, gelu)
    t = run(host, x, w, b, stride, 1, gelu)
    assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")


@pytest.mark.gpu
def test_gpu_scalar_path_matches_twin(device, host, rng):
    x, w, b = rand_bf16(rng, (50, 16)), rand_bf16(rng, (70, 3, 16), 0.2), rand_bf16(rng, (70,))
    g = run(device, x, w, b, 2, 1, True, misalign=True)
    t = run(host, x, w, b, 2, 1, True)
    assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
