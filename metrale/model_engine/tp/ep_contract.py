"""The original engine's `ModelEp` contract (probes.py has the one-rank defaults) on a
multi-rank model: `TensorParallelModel`'s methods of it.

The original runs expert parallelism head/worker: rank 0 runs the scheduler and broadcasts
each command (`ep_broadcast_cmd_for_seq(seq_id, cmd)`, then `ep_broadcast_cmd(word)`s and
`ep_broadcast_tokens(ids)`), and every other rank loops in `ep_worker_step(slots)` running
what it receives. metrale's ranks are SPMD instead: every rank runs the same program (the
scheduler included) and makes the same calls, so there is no worker loop and nothing to
send. What carries over:
  is_ep()               True when the experts are partitioned (expert_parallel=True): a
                        scheduler turns off its single-device fused paths, as it would for
                        the original's EP model.
  ep_protocol_v2()      False: no wire protocol at all.
  ep_broadcast_cmd*, ep_broadcast_tokens
                        collective checks: every rank must make the call with the same
                        values (the agreement step, agreement.py), else TensorParallelError
                        on every rank naming each rank's call; ep_broadcast_tokens returns the
                        ids (what a worker would have received). A scheduler written for the
                        original's head therefore runs unchanged on every rank.
  ep_worker_step(slots) Unsupported: an SPMD rank never waits for commands; calling it means
                        the program was written for a head/worker split.
"""
from __future__ import annotations

from typing import Sequence

from ...errors import Unsupported
from ..guard import exclusive


class SpmdEp:
    """`ModelEp` of a multi-rank model; see the module docstring."""

    def is_ep(self) -> bool:
        return self._shard_plan.expert_parallel

    def ep_protocol_v2(self) -> bool:
        return False

    def ep_worker_step(self, slots) -> bool:
        raise Unsupported("ep_worker_step: metrale's ranks are SPMD (every rank makes the "
                          "same calls, the scheduler's included): there is no worker loop; "
                          "run the same program on every rank instead")

    @exclusive
    def ep_broadcast_cmd(self, cmd: int) -> None:
        """Checks that every rank passed the same `cmd` (nothing is sent)."""
        return None

    @exclusive
    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        """Checks that every rank passed the same (seq_id, cmd)."""
        return None

    @exclusive
    def ep_broadcast_tokens(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` as a list, after checking that every rank passed the same ids."""
        return [int(t) for t in tokens]
