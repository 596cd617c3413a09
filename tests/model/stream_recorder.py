"""A HostBackend that records the stream of every launch, async copy, memset, GEMM, sync,
event and graph operation, with a non-zero default stream so that "0" and "the default
stream" are told apart (on the plain HostBackend both are 0)."""
from __future__ import annotations

from metrale.gpu_runtime import HostBackend


class StreamRecordingBackend(HostBackend):
    DEFAULT = 0x5D

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []   # (operation, stream or None)
        self._next_stream = 0x100

    def default_stream(self) -> int:
        return self.DEFAULT

    def create_stream(self) -> int:
        self._next_stream += 1
        return self._next_stream

    def launch(self, kernel, grid, block, shared_mem, stream, args):
        self.log.append((f"launch {kernel.name}", stream))
        super().launch(kernel, grid, block, shared_mem, stream, args)

    def gemm_bf16(self, m, n, k, x_ptr, w_ptr, y_ptr, stream):
        self.log.append(("gemm", stream))
        super().gemm_bf16(m, n, k, x_ptr, w_ptr, y_ptr, stream)

    def copy_h2d_async(self, src, dst, stream):
        self.log.append(("h2d_async", stream))
        super().copy_h2d_async(src, dst, stream)

    def copy_d2h_async(self, src, dst, stream):
        self.log.append(("d2h_async", stream))
        super().copy_d2h_async(src, dst, stream)

    def copy_d2d_async(self, src, dst, nbytes, stream):
        self.log.append(("d2d_async", stream))
        super().copy_d2d_async(src, dst, nbytes, stream)

    def memset_async(self, ptr, value, nbytes, stream):
        self.log.append(("memset_async", stream))
        super().memset_async(ptr, value, nbytes, stream)

    def copy_d2h(self, src, dst):
        self.log.append(("d2h", None))   # synchronous: must follow a sync of the work's stream
        super().copy_d2h(src, dst)

    def synchronize(self, stream):
        self.log.append(("sync", stream))
        super().synchronize(stream)

    def record_event(self, event, stream):
        self.log.append(("record_event", stream))
        super().record_event(event, stream)

    def stream_wait_event(self, stream, event):
        self.log.append(("stream_wait_event", stream))
        super().stream_wait_event(stream, event)

    def begin_capture(self, stream):
        self.log.append(("begin_capture", stream))
        super().begin_capture(stream)

    def end_capture(self, stream):
        self.log.append(("end_capture", stream))
        return super().end_capture(stream)

    def launch_graph(self, graph, stream):
        self.log.append(("launch_graph", stream))
        super().launch_graph(graph, stream)

    def streams_used(self) -> set:
        return {s for _, s in self.log if s is not None}

    def unsynced_reads(self) -> list[int]:
        """Indices of synchronous reads with stream work queued since the last sync."""
        bad, pending = [], False
        for i, (op, s) in enumerate(self.log):
            if op == "sync":
                pending = False
            elif op == "d2h":
                if pending:
                    bad.append(i)
            elif s is not None and op not in ("record_event", "stream_wait_event"):
                pending = True
        return bad
