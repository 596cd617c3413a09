"""Ragged batches with per-sequence state slots, for the tests of the recurrent kernel
families (causal_conv1d, gated_delta_rule, mamba2_ssd): one call's device arrays
(cu_seqlens, slots, start_pos) and the bookkeeping of which tokens a sequence has seen."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.ops.bf16 import f32_to_bf16

# The ragged sizes of the issue: sequences of 1, 7, 19 and 111 tokens, batches of 1..5.
RAGGED = [(7,), (1, 19), (111, 7, 1), (19, 1, 111, 7), (7, 19, 1, 1, 111)]


@dataclass
class Call:
    """One launch over sequences: host copies of its index arrays and its row range."""
    lens: list[int]
    slots: list[int]
    start: list[int]

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int32)

    @property
    def n_tokens(self) -> int:
        return int(sum(self.lens))

    def upload(self, buf):
        """(cu_seqlens, slots, start_pos) device pointers."""
        return (buf.put(self.cu), buf.put(np.asarray(self.slots, np.int32)),
                buf.put(np.asarray(self.start, np.int32)))


def rand_bf16(rng, shape, scale=1.0) -> np.ndarray:
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def split_rows(rows: np.ndarray, lens) -> list[np.ndarray]:
    """A call's token rows [n_tokens, ...] -> one array per sequence."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    return [rows[cu[i]:cu[i + 1]] for i in range(len(lens))]


def join_rows(parts) -> np.ndarray:
    return np.concatenate(parts) if parts else parts
