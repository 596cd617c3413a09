"""Choosing the next token on the device: the argmax rule for plain greedy, else the
`sampling.sample_rows` kernel with per-row params, seeds and repetition-penalty ids.

Every pick also counts the NaN / Inf values of each logits row (`argmax.count_nonfinite`,
one launch whose counts come back in the same copy as the ids), and a row that has any
raises `NonFiniteLogits` naming it instead of yielding a token: the device argmax gives 0
for an all-NaN row, so weights holding NaN would otherwise print token 0 forever.

One `DeviceSampler` per model keeps its device buffers; they grow on demand (never during
a CUDA-graph capture: sampling runs after the captured decode).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import NonFiniteLogits
from ..gpu_runtime.types import DevicePtr
from ..ops import argmax as argmax_ops
from ..ops import sampling as sampling_ops
from .sampling import SamplingParams


def nonfinite_message(where: str, count: int, vocab: int) -> str:
    """What NonFiniteLogits says about one logits row (`where`: its sequence and position)."""
    return (f"{where}: the logits hold {count} NaN/Inf value(s) of {vocab}; the model's "
            "weights or activations are not finite (a checkpoint holding NaN/Inf, or an "
            "overflow), so no token can be chosen from them")


def check_finite(counts: Sequence[int], vocab: int, where: Callable[[int], str]) -> None:
    """NonFiniteLogits for the first row with a NaN / Inf count; `where(r)` names row r
    (the sequence and position it scores)."""
    for r, c in enumerate(counts):
        if c:
            raise NonFiniteLogits(nonfinite_message(where(r), c, vocab))


def _row(r: int) -> str:
    return f"logits row {r}"


class DeviceSampler:
    def __init__(self, model) -> None:
        self.model = model
        self.backend = model.backend
        self._buffers: dict[str, tuple[DevicePtr, int]] = {}

    def _buf(self, name: str, nbytes: int) -> DevicePtr:
        ptr, size = self._buffers.get(name, (None, 0))
        if size < nbytes:
            if ptr is not None:
                self.backend.free(ptr)
            ptr = self.backend.alloc(max(nbytes, 2 * size))
            self._buffers[name] = (ptr, max(nbytes, 2 * size))
        return ptr

    def greedy(self, logits_ptr: DevicePtr, n: int, stream: int,
               where: Callable[[int], str] = _row) -> list[int]:
        """The device-argmax id of each of `n` logits rows (the model's `argmax_batch`
        rule), after checking the rows are finite (NonFiniteLogits naming `where(r)`)."""
        ids, counts = self.greedy_counts(logits_ptr, n, stream)
        check_finite(counts, self.model.vocab_size(), where)
        return ids

    def greedy_counts(self, logits_ptr: DevicePtr, n: int,
                      stream: int) -> tuple[list[int], list[int]]:
        """(device-argmax ids, NaN/Inf count) of each of `n` logits rows, read in one copy;
        nothing raised: the caller decides what a non-zero count does."""
        m, b = self.model, self.backend
        V = m.vocab_size()
        fp32 = m.logits_ptr_is_fp32(logits_ptr)
        out = self._buf("out", 8 * n)           # [ids n | NaN/Inf counts n] uint32
        argmax_ops.count_nonfinite(b, stream, logits_ptr, out.offset(4 * n), n, V, fp32=fp32)
        if fp32:
            argmax_ops.argmax_fp32(b, stream, logits_ptr, out, n, V)
        else:
            argmax_ops.argmax_bf16_batch(b, stream, logits_ptr, out, n, V)
        return self._read(out, n, stream)

    def check(self, logits_ptr: DevicePtr, n: int, stream: int,
              where: Callable[[int], str] = _row) -> None:
        """NonFiniteLogits if any of `n` logits rows holds NaN / Inf (ids already chosen
        elsewhere, e.g. by `decode_verify`)."""
        m, b = self.model, self.backend
        out = self._buf("counts", 4 * n)
        argmax_ops.count_nonfinite(b, stream, logits_ptr, out, n, m.vocab_size(),
                                   fp32=m.logits_ptr_is_fp32(logits_ptr))
        counts = np.empty(n, np.uint32)
        m.synchronize(stream)   # the model's wait: a tensor-parallel rank's is bounded
        b.copy_d2h(out, counts)
        check_finite(counts.tolist(), m.vocab_size(), where)

    def _read(self, out: DevicePtr, n: int, stream: int) -> tuple[list[int], list[int]]:
        """(ids, counts) from the `[ids n | counts n]` buffer, after `stream`'s work."""
        host = np.empty(2 * n, np.uint32)
        self.model.synchronize(stream)   # the model's wait: a tensor-parallel rank's is bounded
        self.backend.copy_d2h(out, host)
        return [int(x) for x in host[:n]], [int(x) for x in host[n:]]

    def pick(self, logits_ptr: DevicePtr, params: Sequence[SamplingParams], seeds: Sequence[int],
             steps: Sequence[int], history: Sequence[Sequence[int]], stream: int,
             where: Callable[[int], str] = _row) -> list[int]:
        """One token per logits row at `logits_ptr` (rows contiguous, as many as `params`).

        history[i]: the ids the repetition penalty of row i looks at (prompt + generated).
        A row holding NaN / Inf raises NonFiniteLogits naming `where(r)`.
        """
        n = len(params)
        if all(p.is_greedy and p.repetition_penalty == 1.0 for p in params):
            return self.greedy(logits_ptr, n, stream, where)
        m, b = self.model, self.backend
        V = m.vocab_size()
        use_pen = any(p.repetition_penalty != 1.0 for p in params)
        width = max((len(h) for h in history), default=0) if use_pen else 0
        prm = sampling_ops.pack_params(params)
        sd = np.asarray(seeds, np.uint64)
        st = np.asarray(steps, np.uint64)
        p_prm = self._buf("params", prm.nbytes)
        p_sd, p_st = self._buf("seeds", sd.nbytes), self._buf("steps", st.nbytes)
        b.copy_h2d_async(prm, p_prm, stream)
        b.copy_h2d_async(sd, p_sd, stream)
        b.copy_h2d_async(st, p_st, stream)
        p_ids = p_cnt = DevicePtr.NULL
        if width:
            ids = np.full((n, width), -1, np.int32)
            cnt = np.zeros(n, np.int32)
            for i, h in enumerate(history):
                ids[i, : len(h)] = h
                cnt[i] = len(h)
            p_ids, p_cnt = self._buf("pen_ids", ids.nbytes), self._buf("pen_cnt", cnt.nbytes)
            b.copy_h2d_async(ids, p_ids, stream)
            b.copy_h2d_async(cnt, p_cnt, stream)
        out = self._buf("out", 8 * n)           # [ids n | NaN/Inf counts n] uint32
        ws = self._buf("workspace", sampling_ops.workspace_bytes(n, V))
        fp32 = m.logits_ptr_is_fp32(logits_ptr)
        argmax_ops.count_nonfinite(b, stream, logits_ptr, out.offset(4 * n), n, V, fp32=fp32)
        sampling_ops.sample_rows(b, stream, out, logits_ptr, fp32, n, V, p_prm, p_sd, p_st,
                                 p_ids, p_cnt, width, ws)
        ids, counts = self._read(out, n, stream)
        check_finite(counts, V, where)
        return ids

    def free(self) -> None:
        for ptr, _ in self._buffers.values():
            self.backend.free(ptr)
        self._buffers.clear()
