"""embedding_gguf: token rows gathered from a table kept at its GGUF bytes (the planes of
ops/gguf_planes.py), each dequantized on lookup to the load-time dequantizer's bits; the
launcher checks the ids (the kernel reads row ids[t] unchecked)."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.formats.gguf.packed import split_blocks
from metrale.formats.gguf.quants import dequantize_bf16
from metrale.gpu_runtime import NULL
from metrale.ops import embedding
from metrale.ops.gguf_planes import PACKED
from tests.conftest import real
from tests.formats.test_gguf_packed import random_blocks
from tests.helpers import Buffers

TYPES = sorted(PACKED)
IDS = [PACKED[t].name for t in TYPES]


def ks(ggml_type: int) -> list[int]:
    """One block, a few blocks, a real model's width."""
    return [32, 96, 576] if PACKED[ggml_type].qk == 32 else [256, 768]


def run(backend, planes, ids, vocab=None):
    ids = np.asarray(ids, np.int32)
    n, k = ids.size, planes.k
    with Buffers(backend) as b:
        q, meta = b.put(planes.q), b.put(planes.meta)
        qh = NULL if planes.qh is None else b.put(planes.qh)
        ip, op = b.put(ids), b.empty((n, k), np.uint16)
        embedding.embedding_gguf(backend, backend.default_stream(), op, ip, q, qh, meta, n, k,
                                 planes.n if vocab is None else vocab, planes.ggml_type, ids)
        return b.get(op, (n, k), np.uint16)


def table(ggml_type, vocab, k, seed):
    raw = random_blocks(ggml_type, vocab, k, seed, finite=seed % 2 == 0)
    return raw, split_blocks(raw, ggml_type, vocab, k)


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
@pytest.mark.parametrize("n_tokens", [1, 7, 19, 111])
def test_rows_are_the_load_time_dequantizers(host, ggml_type, n_tokens):
    """Every type, ragged token counts, repeated ids, the first and last rows, and NaN /
    inf scales (odd seeds: random scale bytes): the rows of dequantize_bf16."""
    rng = np.random.default_rng([ggml_type, n_tokens])
    vocab = 37
    for seed, k in enumerate(ks(ggml_type)):
        raw, planes = table(ggml_type, vocab, k, seed)
        want = dequantize_bf16(raw, ggml_type, (vocab, k), native=False)
        ids = rng.integers(0, vocab, n_tokens)
        ids[0], ids[-1] = vocab - 1, 0
        assert np.array_equal(run(host, planes, ids), want[ids]), (k, seed)


def test_bad_ids_and_arguments_are_refused_before_launch(host):
    raw, p = table(12, 5, 256, 0)
    for ids, bad in (([0, 5], "token id 5 at index 1 is outside [0, vocab=5)"),
                     ([-1, 2], "token id -1 at index 0")):
        with pytest.raises(InvalidArgument, match=bad.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)")):
            run(host, p, ids)
    with Buffers(host) as b:
        q, meta, ip, op = b.put(p.q), b.put(p.meta), b.put(np.zeros(2, np.int32)), \
            b.empty((2, 256), np.uint16)
        go = embedding.embedding_gguf
        with pytest.raises(InvalidArgument, match="ids has shape"):
            go(host, 0, op, ip, q, NULL, meta, 2, 256, 5, 12, np.zeros(3, np.int32))
        with pytest.raises(InvalidArgument, match="multiple of Q4_K's block of 256"):
            go(host, 0, op, ip, q, NULL, meta, 2, 128, 5, 12, np.zeros(2, np.int32))
        with pytest.raises(InvalidArgument, match="Q4_K has no qh plane"):
            go(host, 0, op, ip, q, meta, meta, 2, 256, 5, 12, np.zeros(2, np.int32))
        with pytest.raises(InvalidArgument, match="Q6_K needs a qh plane"):
            go(host, 0, op, ip, q, NULL, meta, 2, 256, 5, 14, np.zeros(2, np.int32))
        with pytest.raises(InvalidArgument, match="not kept packed"):
            go(host, 0, op, ip, q, NULL, meta, 2, 256, 5, 1, np.zeros(2, np.int32))
        with pytest.raises(InvalidArgument, match="out_ptr is NULL"):
            go(host, 0, NULL, ip, q, NULL, meta, 2, 256, 5, 12, np.zeros(2, np.int32))
        with pytest.raises(InvalidArgument, match="q_ptr .* is not 16-byte aligned"):
            go(host, 0, op, ip, q.offset(8), NULL, meta, 2, 256, 5, 12, np.zeros(2, np.int32))


def test_a_negative_id_reaching_the_twin_is_refused(host):
    """The twin reads the device ids: one the launcher did not see is refused, not wrapped
    to the table's end (numpy's negative index)."""
    raw, p = table(8, 5, 32, 0)
    with Buffers(host) as b:
        q, meta = b.put(p.q), b.put(p.meta)
        ip, op = b.put(np.array([-1], np.int32)), b.empty((1, 32), np.uint16)
        kern = host.kernel(embedding.MODULE, embedding.gguf_kernel_name(8))
        with pytest.raises(InvalidArgument, match="token id -1"):
            host.launch(kern, (1,), (128,), 0, 0, (op, ip, q, NULL, meta, np.int32(1),
                                                   np.int32(32)))


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
@pytest.mark.parametrize("vocab, k32, k256, n_tokens", [(37, 576, 768, 111),
                                                        real(32000, 896, 4096, 300)])
def test_gpu_matches_twin(device, host, ggml_type, vocab, k32, k256, n_tokens):
    """The kernel (kernels/embedding.cu, embedding_gguf_{type}) against the twin, the
    first and last rows and repeats included."""
    k = k32 if PACKED[ggml_type].qk == 32 else k256
    _, planes = table(ggml_type, vocab, k, 1)
    ids = np.random.default_rng(ggml_type).integers(0, vocab, n_tokens)
    ids[0], ids[-1] = vocab - 1, 0
    assert np.array_equal(run(device, planes, ids), run(host, planes, ids))
