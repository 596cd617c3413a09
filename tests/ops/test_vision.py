"""vision family: CLIP patch embedding helpers (im2col and class token + learned positions)."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import vision
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def im2col_loops(px, p):
    """Independent formula: one loop per (patch, channel, ky, kx)."""
    c, h, w = px.shape
    gh, gw = h // p, w // p
    out = np.empty((gh * gw, c * p * p), np.float64)
    for py in range(gh):
        for pxi in range(gw):
            col = 0
            for ch in range(c):
                for ky in range(p):
                    for kx in range(p):
                        out[py * gw + pxi, col] = px[ch, py * p + ky, pxi * p + kx]
                        col += 1
    return out


def run_patchify(backend, px, p):
    c, h, w = px.shape
    n = vision.num_patches(h, w, p)
    with Buffers(backend) as b:
        src, dst = b.put(px.astype(np.float32)), b.empty((n, c * p * p), np.uint16)
        vision.patchify(backend, backend.default_stream(), dst, src, c, h, w, p)
        return b.get(dst, (n, c * p * p), np.uint16)


def run_class_pos(backend, x, cls, pos):
    r, d = x.shape
    with Buffers(backend) as b:
        xp, cp, pp = b.put(x), b.put(cls), b.put(pos)
        vision.class_pos_embed(backend, backend.default_stream(), xp, cp, pp, r, d)
        return b.get(xp, (r, d), np.uint16)


def test_entry_points_exist():
    assert {"patchify", "class_pos_embed"} <= set(kernel_source.entry_points(vision.MODULE))


@pytest.mark.parametrize("c,h,w,p", [(3, 32, 32, 8), (3, 14, 14, 14), (1, 9, 7, 3), (3, 20, 13, 4),
                                     (2, 5, 5, 1)])
def test_patchify_matches_formula(host, rng, c, h, w, p):
    px = rng.standard_normal((c, h, w)).astype(np.float32)
    got = run_patchify(host, px, p)
    ref = im2col_loops(px, p)
    assert np.array_equal(got, f32_to_bf16(ref.astype(np.float32)))  # one rounding, exact


def test_patchify_conv_equivalence(host, rng):
    """patches @ W^T is the stride-p convolution with W [d, C, p, p]."""
    c, h, p, d = 3, 16, 4, 5
    px = rng.standard_normal((c, h, h)).astype(np.float32)
    wt = rng.standard_normal((d, c, p, p))
    got = bf16_to_f32(run_patchify(host, px, p)).astype(np.float64) @ wt.reshape(d, -1).T
    g = h // p
    conv = np.zeros((g * g, d))
    pxr = bf16_to_f32(f32_to_bf16(px)).astype(np.float64)
    for i in range(g):
        for j in range(g):
            conv[i * g + j] = np.einsum("dcyx,cyx->d", wt, pxr[:, i * p:(i + 1) * p,
                                                             j * p:(j + 1) * p])
    np.testing.assert_allclose(got, conv, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rows,d", [(1, 8), (17, 32), (5, 7), (50, 1025)])
def test_class_pos_embed_matches_formula(host, rng, rows, d):
    x, cls, pos = rand_bf16(rng, (rows, d)), rand_bf16(rng, (d,)), rand_bf16(rng, (rows, d))
    x[0] = 0xFFFF  # row 0 is never read (NaN bits must not leak)
    got = run_class_pos(host, x, cls, pos)
    ref = bf16_to_f32(x).astype(np.float64)
    ref[0] = bf16_to_f32(cls)
    ref = ref + bf16_to_f32(pos)
    assert_close(bf16_to_f32(got), ref, "twin_bf16")
    assert np.array_equal(got, f32_to_bf16(ref.astype(np.float32)))


def test_bad_arguments_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="patch"):
        vision.patchify(host, 0, 8, 8, 3, 4, 4, 8)
    with pytest.raises(InvalidArgument, match="channels"):
        vision.patchify(host, 0, 8, 8, 0, 4, 4, 2)
    with pytest.raises(InvalidArgument, match="NULL"):
        vision.patchify(host, 0, 0, 8, 3, 4, 4, 2)
    with pytest.raises(InvalidArgument, match="n_rows"):
        vision.class_pos_embed(host, 0, 8, 8, 8, 0, 4)
    with pytest.raises(InvalidArgument, match="NULL"):
        vision.class_pos_embed(host, 0, 8, 0, 8, 2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("c,h,w,p", [(3, 336, 336, 14), (3, 224, 224, 32), (1, 9, 7, 3)])
def test_patchify_gpu_matches_twin(device, host, rng, c, h, w, p):
    px = rng.standard_normal((c, h, w)).astype(np.float32)
    assert np.array_equal(run_patchify(device, px, p), run_patchify(host, px, p))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,d", [(577, 1024), (17, 32), (5, 7)])
def test_class_pos_embed_gpu_matches_twin(device, host, rng, rows, d):
    x, cls, pos = rand_bf16(rng, (rows, d)), rand_bf16(rng, (d,)), rand_bf16(rng, (rows, d))
    assert np.array_equal(run_class_pos(device, x, cls, pos), run_class_pos(host, x, cls, pos))
