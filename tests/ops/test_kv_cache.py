"""kv_cache family: write_kv scatters k/v heads into paged slots bit for bit, slots < 0 are
skipped, copy_blocks copies whole blocks; the GPU kernel equals the twin exactly."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument, KernelError
from metrale.gpu_runtime import NULL
from metrale.ops import kv_cache
from tests.helpers import Buffers

SENTINEL = 0x7E7E


def run_write(backend, qkv, slots, num_blocks, bs, h, kv, d):
    n = qkv.shape[0]
    shape = (num_blocks, bs, kv, d)
    with Buffers(backend) as b:
        qp = b.put(qkv)
        kp = b.put(np.full(shape, SENTINEL, np.uint16))
        vp = b.put(np.full(shape, SENTINEL, np.uint16))
        sp = b.put(np.asarray(slots, np.int32))
        kv_cache.write_kv(backend, backend.default_stream(), qp, kp, vp, sp, n, h, kv, d)
        return b.get(kp, shape, np.uint16), b.get(vp, shape, np.uint16)


def ref_write(qkv, slots, num_blocks, bs, h, kv, d):
    k = np.full((num_blocks * bs, kv * d), SENTINEL, np.uint16)
    v = k.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            k[s] = qkv[t, h * d:(h + kv) * d]
            v[s] = qkv[t, (h + kv) * d:]
    return k.reshape(num_blocks, bs, kv, d), v.reshape(num_blocks, bs, kv, d)


def case(rng, n, h, kv, d, bs, pad_every=0):
    num_blocks = -(-n // bs) + 3
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int32)  # shuffled physical slots
    if pad_every:
        slots[::pad_every] = -1
    qkv = rng.integers(0, 2**16, size=(n, (h + 2 * kv) * d), dtype=np.uint16)
    return qkv, slots, num_blocks


@pytest.mark.parametrize("n", [1, 7, 19, 111])
@pytest.mark.parametrize("h,kv,d,bs", [(8, 2, 64, 16), (4, 1, 128, 16), (2, 2, 32, 5),
                                       (3, 1, 6, 16)])
def test_write_kv_twin(host, rng, n, h, kv, d, bs):
    qkv, slots, nb = case(rng, n, h, kv, d, bs, pad_every=3 if n > 3 else 0)
    gk, gv = run_write(host, qkv, slots, nb, bs, h, kv, d)
    wk, wv = ref_write(qkv, slots, nb, bs, h, kv, d)
    assert np.array_equal(gk, wk) and np.array_equal(gv, wv)


def test_write_kv_slot_outside_cache_raises_in_twin(host, rng):
    qkv, _, _ = case(rng, 2, 2, 1, 32, 16)
    with pytest.raises(KernelError, match="slot_mapping"):
        run_write(host, qkv, [0, 2 * 16], 2, 16, 2, 1, 32)


def test_copy_blocks(host, rng):
    nb, bs, kv, d = 5, 16, 2, 64
    k = rng.integers(0, 2**16, size=(nb, bs, kv, d), dtype=np.uint16)
    v = rng.integers(0, 2**16, size=(nb, bs, kv, d), dtype=np.uint16)
    with Buffers(host) as b:
        kp, vp = b.put(k), b.put(v)
        kv_cache.copy_blocks(host, 0, kp, vp, 3, 1, bs, kv, d)
        gk, gv = b.get(kp, k.shape, np.uint16), b.get(vp, v.shape, np.uint16)
    wk, wv = k.copy(), v.copy()
    wk[1], wv[1] = k[3], v[3]
    assert np.array_equal(gk, wk) and np.array_equal(gv, wv)


def test_bad_arguments_raise_before_launch(host):
    for args, msg in [((0, 4, 2, 64), "n_tokens"), ((3, 4, 3, 64), "multiple"),
                      ((3, 4, 2, 65), "head_dim"), ((3, 4, 2, 512), "head_dim"),
                      ((3, 0, 1, 64), "num_heads")]:
        with pytest.raises(InvalidArgument, match=msg):
            kv_cache.write_kv(host, 0, 64, 64, 64, 64, *args)
    with pytest.raises(InvalidArgument, match="NULL"):
        kv_cache.write_kv(host, 0, 64, NULL, 64, 64, 3, 4, 2, 64)
    with pytest.raises(InvalidArgument, match="same block"):
        kv_cache.copy_blocks(host, 0, 64, 64, 2, 2, 16, 2, 64)
    with pytest.raises(InvalidArgument, match=">= 0"):
        kv_cache.copy_blocks(host, 0, 64, 64, -1, 2, 16, 2, 64)
    with pytest.raises(InvalidArgument, match="block_size"):
        kv_cache.copy_blocks(host, 0, 64, 64, 1, 2, 0, 2, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,kv,d,bs", [(1, 32, 8, 128, 16), (111, 32, 8, 128, 16),
                                         (19, 28, 4, 128, 16), (7, 4, 1, 64, 16),
                                         (19, 3, 1, 6, 5), (33, 2, 2, 256, 32)])
def test_gpu_matches_twin(device, host, rng, n, h, kv, d, bs):
    qkv, slots, nb = case(rng, n, h, kv, d, bs, pad_every=4 if n > 4 else 0)
    gk, gv = run_write(device, qkv, slots, nb, bs, h, kv, d)
    tk, tv = run_write(host, qkv, slots, nb, bs, h, kv, d)
    assert np.array_equal(gk, tk) and np.array_equal(gv, tv)
    k = rng.integers(0, 2**16, size=(4, bs, kv, d), dtype=np.uint16)
    outs = []
    for be in (device, host):
        with Buffers(be) as b:
            kp, vp = b.put(k), b.put(k[::-1].copy())
            kv_cache.copy_blocks(be, be.default_stream(), kp, vp, 0, 3, bs, kv, d)
            outs.append((b.get(kp, k.shape, np.uint16), b.get(vp, k.shape, np.uint16)))
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
