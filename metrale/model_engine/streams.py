"""`ModelStreams`: the stream handles a caller passes to every forward method."""
from __future__ import annotations


class ModelStreams:
    def default_stream(self) -> int:
        """The model's compute stream (a non-blocking stream on CUDA, 0 on the host)."""
        return self.backend.default_stream()

    def synchronize(self, stream: int) -> None:
        """Block until all work queued on `stream` is done."""
        self.backend.synchronize(stream)
