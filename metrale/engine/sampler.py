"""Choosing the next token on the device: the argmax rule for plain greedy, else the
`sampling.sample_rows` kernel with per-row params, seeds and repetition-penalty ids.

One `DeviceSampler` per model keeps its device buffers; they grow on demand (never during
a CUDA-graph capture: sampling runs after the captured decode).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..gpu_runtime.types import DevicePtr
from ..ops import sampling as sampling_ops
from .sampling import SamplingParams


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

    def pick(self, logits_ptr: DevicePtr, params: Sequence[SamplingParams], seeds: Sequence[int],
             steps: Sequence[int], history: Sequence[Sequence[int]], stream: int) -> list[int]:
        """One token per logits row at `logits_ptr` (rows contiguous, as many as `params`).

        history[i]: the ids the repetition penalty of row i looks at (prompt + generated).
        """
        n = len(params)
        if all(p.is_greedy and p.repetition_penalty == 1.0 for p in params):
            return self.model.argmax_batch(logits_ptr, n, stream)
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
        out = self._buf("out", 4 * n)
        ws = self._buf("workspace", sampling_ops.workspace_bytes(n, V))
        sampling_ops.sample_rows(b, stream, out, logits_ptr, m.logits_ptr_is_fp32(logits_ptr), n,
                                 V, p_prm, p_sd, p_st, p_ids, p_cnt, width, ws)
        host = np.empty(n, np.uint32)
        b.synchronize(stream)
        b.copy_d2h(out, host)
        return [int(x) for x in host]

    def free(self) -> None:
        for ptr, _ in self._buffers.values():
            self.backend.free(ptr)
        self._buffers.clear()
