"""Scenario `streams` of tests/tp/worker.py: the stream rules of one device
(tests/model/test_pointer_streams.py) on a tensor-parallel rank, where the collectives are
stream work too. Stream handle 0 puts every launch, copy, collective and sync on the
default stream; a forward pass on an explicit stream runs its collectives there; device
argmax runs on the default stream after it has waited for the caller's (the original's
meta_argmax.rs rule); no host read races the stream's work."""
from __future__ import annotations

import metrale
from tests.model.common import FIXTURES
from tests.model.stream_recorder import StreamRecordingBackend
from tests.model.test_pointer_streams import IDS, every_entry_point


class CollectiveRecordingBackend(StreamRecordingBackend):
    """StreamRecordingBackend that also logs the MPI communicator's collectives (each one
    task on the stream it is given, comm/mpi.py)."""

    def host_task(self, fn, stream):
        self.log.append(("collective", stream))
        super().host_task(fn, stream)


def _summary(be) -> dict:
    return {"used": sorted(be.streams_used()), "unsynced": be.unsynced_reads(),
            "collectives": sorted({s for op, s in be.log if op == "collective"}),
            "n_collectives": sum(op == "collective" for op, _ in be.log)}


def streams(run) -> None:
    out = run.facts.setdefault("streams", {"default": CollectiveRecordingBackend.DEFAULT})
    for graphs in (False, True):
        be = CollectiveRecordingBackend()
        m = metrale.load(FIXTURES / "llama_gqa", be, tensor_parallel_size=run.size,
                         progress=False, kv_blocks=64, block_size=4, graphs=graphs)
        be.log.clear()
        every_entry_point(m, 0)
        out[f"zero/graphs={graphs}"] = _summary(be)
        m.teardown()
    be = CollectiveRecordingBackend()
    # eager: the collectives of one decode step (a graphed first step also captures them)
    m = metrale.load(FIXTURES / "llama_gqa", be, tensor_parallel_size=run.size,
                     progress=False, kv_blocks=64, block_size=4, graphs=False)
    s2 = m.create_stream()
    seq = m.alloc_sequence()
    m.prefill(IDS[:5], seq, m.default_stream())
    be.log.clear()
    ptr = m.decode(IDS[5], seq, s2)
    out["decode_on_s2"] = {**_summary(be), "s2": s2}
    be.log.clear()
    picked = m.argmax_on_device(ptr, s2)
    out["argmax_on_s2"] = {**_summary(be), "first": [list(x) for x in be.log[:2]],
                           "launch_streams": sorted({s for op, s in be.log
                                                     if op.startswith("launch")})}
    out["argmax_ids"] = [picked, m.argmax_on_device(ptr, 0)]
    m.teardown()
