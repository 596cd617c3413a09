"""Ragged batches with per-sequence state slots, for the tests of the recurrent kernel
families (causal_conv1d, gated_delta_rule, mamba2_ssd): one call's device arrays
(cu_seqlens, slots, start_pos) and the bookkeeping of which tokens a sequence has seen."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import TOL, rel_max_error

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


def assert_rel_max(got_bf16, want, state=None, want_state=None, what="") -> None:
    """BF16 output bits against FP32 (or BF16 bits, `want` uint16) values, and optionally an
    FP32 state, relative to the largest value (conftest's recurrent_*_rel_max)."""
    w = bf16_to_f32(want) if want.dtype == np.uint16 else want
    err = rel_max_error(bf16_to_f32(got_bf16), w)
    assert err <= TOL["recurrent_bf16_rel_max"][0], f"{what} outputs: rel max error {err:.3g}"
    if state is not None:
        err = rel_max_error(state, want_state)
        assert err <= TOL["recurrent_state_rel_max"][0], f"{what} state: rel max error {err:.3g}"


def assert_kernel_matches_twin(got, want) -> None:
    """(BF16 out bits, FP32 state) of a kernel against its twin's."""
    assert_rel_max(got[0], want[0], got[1], want[1], "kernel against twin:")
