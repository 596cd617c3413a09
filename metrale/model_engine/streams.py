"""`ModelStreams`: the stream handles a caller passes to every forward method, and the
events that order work across streams (`crates/model-engine/src/traits/model/streams.rs`).

Stream handle 0 is the original engine's conventional "default": every entry point of the
model runs work that a caller started with 0 on `default_stream()` (a non-blocking stream
on CUDA), never on CUDA's legacy stream, which the model's own stream does not order
against. Any other handle is used as given by the forward passes.

The reads the original runs on its default stream whatever handle it is given (device
argmax, `save_hidden_for_mtp`: `_stream` ignored in `trait_impl/meta_argmax.rs` and
`speculative.rs`) run there here too, after the default stream has waited (an event, on the
device) for the caller's stream: they see everything queued on the default stream, as a
port from Rust expects, and everything the caller queued on its own stream.
"""
from __future__ import annotations

from .args import int_arg


class ModelStreams:
    _order_event: int | None = None   # created at the first cross-stream read
    def default_stream(self) -> int:
        """The model's compute stream (a non-blocking stream on CUDA, 0 on the host)."""
        return self.backend.default_stream()

    def create_stream(self) -> int:
        """A new stream on the model's device."""
        return self.backend.create_stream()

    def create_event(self) -> int:
        """A new event, for ordering work across streams."""
        return self.backend.create_event()

    def record_event(self, event: int, stream: int) -> None:
        """Record `event` at the current point of `stream`'s work (0: the default stream)."""
        self.backend.record_event(event, self._stream_of(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make `stream` wait on the device for `event`; the host does not block."""
        self.backend.stream_wait_event(self._stream_of(stream), event)

    def synchronize(self, stream: int) -> None:
        """Block until all work queued on `stream` is done (0: the default stream)."""
        self.backend.synchronize(self._stream_of(stream))

    def _default_after(self, stream) -> int:
        """The default stream, made to wait on the device for `stream`'s queued work when
        `stream` is another stream (0 or the default itself: nothing to wait for)."""
        s = self._stream_of(stream)
        default = self.default_stream()
        if s != default:
            if self._order_event is None:
                self._order_event = self.backend.create_event()
            self.backend.record_event(self._order_event, s)
            self.backend.stream_wait_event(default, self._order_event)
        return default

    def _stream_of(self, stream) -> int:
        """The stream work runs on: 0 means `default_stream()`."""
        s = int_arg("stream", "stream", stream, 0)
        return self.default_stream() if s == 0 else s
