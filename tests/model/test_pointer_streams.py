"""Stream handle 0 (issue 18 item 1), the padded batch ladder (item 8) and free(NULL)
(item 9): a scheduler ported from the Rust engine passes the conventional 0 and every
launch, copy and sync must land on the model's default stream, never CUDA's legacy one."""
from types import SimpleNamespace

import numpy as np
import pytest

from metrale import InvalidArgument
from metrale.gpu_runtime import DevicePtr, HostBackend
from metrale.model_engine import PrefillSlice, padded_batch_n
from tests.model.common import golden, load
from tests.model.stream_recorder import StreamRecordingBackend

NAME = "llama_gqa"
IDS = golden(NAME)["input_ids"][0].tolist()


def every_entry_point(m, s):
    """Call every pointer-API entry point that takes a stream, with stream handle `s`."""
    a, b, c, d = (m.alloc_sequence() for _ in range(4))
    p = m.prefill(IDS[:6], a, s)
    m.argmax_on_device(p, s)
    m.prefill_chunk(IDS[:9], b, 0, 4, False, s)
    m.prefill_chunk(IDS[:9], b, 4, 5, True, s)
    m.prefill_twophase(IDS[:5], c, 4, s)
    rows = m.decode_batch([IDS[6], IDS[9], IDS[5]], [a, b, c], s)
    m.argmax_batch(rows, 3, s)
    m.argmax_batch_masked(rows, 3, [[1], [], [2, 3]], s)
    m.copy_logits_to_host(rows, bytearray(64))
    m.logits_to_numpy(rows, 2)
    m.decode(IDS[7], a, s)
    m.decode_verify([IDS[8], 5, 6], a, s)
    res = m.mixed_forward_batch([IDS[10]], [b], [PrefillSlice(IDS[:7], d, 0, 7, True)], s)
    m.argmax_on_device(res.prefill_logits[0], s)
    m.mixed_forward([IDS[6]], [c], IDS[:12], m.alloc_sequence(), 0, 5, False, s)
    m.prefill_batch_chunk_rows([PrefillSlice(IDS[:3], m.alloc_sequence(), 0, 3, True)], s, 1)
    e = m.create_event()
    m.record_event(e, s)
    m.stream_wait_event(s, e)
    m.copy_d2h_async(rows, np.empty(8, np.uint8), s)
    m.synchronize(s)


@pytest.mark.parametrize("graphs", [False, True])
def test_stream_zero_is_the_default_stream_for_every_launch_copy_and_sync(graphs):
    be = StreamRecordingBackend()
    m = load(NAME, be, kv_blocks=64, block_size=4, graphs=graphs)
    be.log.clear()
    every_entry_point(m, 0)
    assert be.streams_used() == {be.DEFAULT}, sorted(be.streams_used())
    assert any(op.startswith("launch") for op, _ in be.log)
    if graphs:
        assert ("begin_capture", be.DEFAULT) in be.log and ("launch_graph", be.DEFAULT) in be.log
    assert be.unsynced_reads() == [], "a host read raced the stream's work"


def test_an_explicit_stream_is_used_as_given():
    be = StreamRecordingBackend()
    m = load(NAME, be, kv_blocks=64, block_size=4)
    s2 = m.create_stream()
    seq = m.alloc_sequence()
    m.prefill(IDS[:5], seq, m.default_stream())
    be.log.clear()
    ptr = m.decode(IDS[5], seq, s2)
    assert be.streams_used() == {s2}          # a forward pass runs on the stream given
    be.log.clear()
    m.argmax_on_device(ptr, s2)
    # the argmax runs on the default stream, as the original's (meta_argmax.rs ignores the
    # handle), after the default stream has waited on the device for s2's work
    assert be.log[:2] == [("record_event", s2), ("stream_wait_event", be.DEFAULT)]
    launches = {s for op, s in be.log if op.startswith("launch")}
    assert launches == {be.DEFAULT} and be.unsynced_reads() == []
    with pytest.raises(InvalidArgument, match="stream"):
        m.decode(IDS[6], seq, -1)
    with pytest.raises(InvalidArgument, match="stream"):
        m.decode(IDS[6], seq, "0")


def test_argmax_sees_the_default_streams_work_whatever_handle_it_gets():
    """A Rust port may pass any handle to argmax_* (the original ignores it): the argmax
    is ordered after everything queued on the default stream, and nothing is waited for
    when the handle is 0 or the default stream itself."""
    be = StreamRecordingBackend()
    m = load(NAME, be, kv_blocks=64, block_size=4)
    other = m.create_stream()
    seq = m.alloc_sequence()
    p = m.prefill(IDS[:5], seq, 0)            # the forward on the default stream
    be.log.clear()
    a = m.argmax_on_device(p, other)
    first_launch = next(i for i, (op, _) in enumerate(be.log) if op.startswith("launch"))
    assert ("stream_wait_event", be.DEFAULT) in be.log[:first_launch]
    assert all(s == be.DEFAULT for op, s in be.log if op.startswith("launch"))
    for h in (0, be.DEFAULT):
        be.log.clear()
        assert m.argmax_batch(p, 1, h) == [a]
        assert not any(op.endswith("event") for op, _ in be.log)


def fake_cuda_backend():
    """A CudaBackend without a GPU: its runtime calls are recorded instead of made."""
    from metrale.gpu_runtime.cuda import CudaBackend
    calls = []

    class Runtime:
        memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3

        def memcpyAsync(self, dst, src, n, kind, stream):
            calls.append(("memcpyAsync", stream))

        def memsetAsync(self, ptr, value, n, stream):
            calls.append(("memsetAsync", stream))

    be = CudaBackend.__new__(CudaBackend)
    be.cp = SimpleNamespace(cuda=SimpleNamespace(runtime=Runtime()))
    be._default = SimpleNamespace(ptr=0xABC0)
    be._streams = {0xABC0: be._default}
    be._mem, be._sizes, be._starts, be._live = {}, {}, [], 0
    return be, calls


def test_cuda_backend_never_hands_stream_zero_to_the_runtime():
    be, calls = fake_cuda_backend()
    be.copy_h2d_async(np.zeros(4, np.uint8), DevicePtr(64), 0)
    be.copy_d2h_async(DevicePtr(64), np.zeros(4, np.uint8), 0)
    be.copy_d2d_async(DevicePtr(64), DevicePtr(128), 4, 0)
    be.memset_async(DevicePtr(64), 0, 4, 0)
    assert calls == [(op, 0xABC0) for op in ("memcpyAsync",) * 3 + ("memsetAsync",)]
    assert be._stream(0) is be._default


def test_free_null_is_a_no_op_on_every_backend():
    host = HostBackend()
    live = host.live_bytes()
    host.free(DevicePtr(0))
    host.free(0)
    assert host.live_bytes() == live
    with pytest.raises(InvalidArgument):
        host.free(DevicePtr(12345))       # a pointer that is not an allocation still fails
    be, _ = fake_cuda_backend()
    be.free(DevicePtr(0))


@pytest.mark.parametrize("n,want", [(0, 2), (1, 2), (2, 2), (3, 4), (5, 8), (9, 12), (13, 16),
                                    (16, 16), (17, 24), (25, 32), (32, 32), (33, 48),
                                    (48, 48), (49, 64), (64, 64), (65, 96), (96, 96),
                                    (97, 128), (128, 128), (129, 129), (1000, 1000)])
def test_padded_batch_n_is_the_rust_ladder(n, want):
    assert padded_batch_n(n) == want


def test_padded_batch_n_refuses_non_counts():
    for bad in (-1, 2.0, True, None):
        with pytest.raises(InvalidArgument):
            padded_batch_n(bad)


def decode_graph_keys(m) -> list:
    """The graph keys after a 1-row decode, then after a 3-row decode_batch."""
    s = m.default_stream()
    seqs = [m.alloc_sequence() for _ in range(3)]
    for q in seqs:
        m.prefill(IDS[:4], q, s)
    m.decode(IDS[4], seqs[0], s)
    keys = [set(m._graphs)]
    m.decode_batch([1, 2, 3], seqs, s)
    return keys + [set(m._graphs)]


@pytest.mark.gpu
def test_decode_graphs_are_keyed_by_the_ladder(device):
    m = load(NAME, device, kv_blocks=64, block_size=4, graphs=True)
    # one row pads to 2: the ladder has no rung 1
    assert decode_graph_keys(m) == [{2}, {2, 4}]


def test_host_decode_graphs_are_on_and_keyed_by_the_row_count():
    m = load(NAME, HostBackend(), kv_blocks=64, block_size=4)
    assert m._use_graphs
    assert decode_graph_keys(m) == [{1}, {1, 3}]


class PaddingHost(HostBackend):
    """A HostBackend that says it pads decode graphs and does not graph unless told: the
    model asks the backend's properties, not its name."""
    pads_decode_graphs = True
    decode_graphs_by_default = False


def test_decode_graph_padding_and_default_are_backend_properties():
    from metrale.gpu_runtime import EmuBackend
    from metrale.gpu_runtime.emu.trace import TraceBackend
    assert (HostBackend.pads_decode_graphs, HostBackend.decode_graphs_by_default) == (False, True)
    from metrale.gpu_runtime.cuda import CudaBackend   # (CuPy is imported by its __init__)
    assert (CudaBackend.pads_decode_graphs, CudaBackend.decode_graphs_by_default) == (True, True)
    for cls in (EmuBackend, TraceBackend):   # both stand for a GPU: padded, graphs on request
        assert (cls.pads_decode_graphs, cls.decode_graphs_by_default) == (True, False)
    assert not load(NAME, PaddingHost(), kv_blocks=64, block_size=4)._use_graphs
    m = load(NAME, PaddingHost(), kv_blocks=64, block_size=4, graphs=True)
    assert decode_graph_keys(m) == [{2}, {2, 4}]   # the ladder, as on a GPU


@pytest.mark.gpu
def test_gpu_stream_zero_orders_after_the_models_stream(cuda):
    m = load(NAME, cuda, kv_blocks=64, block_size=4, graphs=True)
    seqs = [m.alloc_sequence() for _ in range(3)]
    for q in seqs:
        m.prefill(IDS[:5], q, 0)
    for step in range(4):   # graph capture and replay with stream 0
        rows = m.decode_batch([IDS[5 + step]] * 3, seqs, 0)
        ids = m.argmax_batch(rows, 3, 0)
        host = m.logits_to_numpy(rows, 3)
        from metrale.ops.argmax import argmax_rule
        assert ids == [int(i) for i in argmax_rule(host)]
