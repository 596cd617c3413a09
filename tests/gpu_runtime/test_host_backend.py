"""HostBackend: memory, bounds checks, copies, memset, offsets, twin launches, graph capture."""
import logging
import os

import numpy as np
import pytest

from metrale import DeviceError, InvalidArgument, KernelError
from metrale.gpu_runtime import NULL, DevicePtr, GpuBackend, HostBackend, backend
from metrale.ops import argmax


def test_protocol_and_pointer_type():
    h = HostBackend()
    assert isinstance(h, GpuBackend)
    p = h.alloc(64)
    assert isinstance(p, DevicePtr) and not p.is_null() and int(p) % 256 == 0
    assert p.offset(16) == int(p) + 16 and isinstance(p.offset(16), DevicePtr)
    assert NULL.is_null() and DevicePtr.NULL == 0
    with pytest.raises(KernelError):
        NULL.offset(4)
    h.free(p)


def test_live_bytes_and_free():
    h = HostBackend()
    a, b = h.alloc(100), h.alloc(28)
    assert h.live_bytes() == 128
    h.free(a)
    assert h.live_bytes() == 28
    with pytest.raises(InvalidArgument):
        h.free(a)
    h.free(b)
    assert h.live_bytes() == 0 and h.peak_bytes() == 128


def test_copies_roundtrip_and_offsets():
    h = HostBackend()
    src = np.arange(19, dtype=np.float32)
    p = h.alloc(src.nbytes)
    h.copy_h2d(src, p)
    out = np.zeros(7, np.float32)
    h.copy_d2h(p.offset(4 * 5), out)
    assert np.array_equal(out, src[5:12])
    q = h.alloc(src.nbytes)
    h.copy_d2d(p, q, src.nbytes)
    h.memset(q, 0, 8)
    got = bytearray(src.nbytes)
    h.copy_d2h(q, got)
    arr = np.frombuffer(bytes(got), np.float32)
    assert np.all(arr[:2] == 0) and np.array_equal(arr[2:], src[2:])
    # async forms on stream 0 behave the same
    h.copy_h2d_async(bytes(src[:1].tobytes()), q, 0)
    h.copy_d2h_async(q, out[:1], 0)
    assert out[0] == src[0]


def test_fresh_memory_is_nan_filled():
    h = HostBackend()       # the test suite poisons (tests/conftest.py)
    assert h.poison
    p = h.alloc(8)
    out = np.zeros(2, np.float32)
    h.copy_d2h(p, out)
    assert np.all(np.isnan(out))


def test_users_get_lazily_zeroed_memory(monkeypatch):
    monkeypatch.delenv("METRALE_POISON_MEMORY")
    h = HostBackend()
    assert not h.poison and HostBackend(poison=True).poison
    p = h.alloc(1 << 30)    # 1 GiB: zero pages, no fill (a 0xFF fill takes ~0.5 s)
    out = np.ones(4, np.float32)
    h.copy_d2h(p.offset((1 << 30) - 16), out)
    assert np.all(out == 0)
    h.copy_h2d(np.arange(4, dtype=np.float32), p.offset(1 << 29))
    h.copy_d2h(p.offset(1 << 29), out)
    assert list(out) == [0, 1, 2, 3]
    small = h.alloc(100)    # below LAZY_MAP_MIN: calloc'd
    h.copy_d2h(small, out)
    assert np.all(out == 0)
    h.free(p)
    h.free(small)


def test_out_of_bounds_is_caught():
    h = HostBackend()
    p = h.alloc(16)
    with pytest.raises(KernelError, match="past the end"):
        h.view(p.offset(8), 3, np.float32)
    with pytest.raises(KernelError, match="not inside"):
        h.view(DevicePtr(int(p) - 4096), 1, np.uint8)
    out = np.zeros(5, np.float32)
    with pytest.raises(KernelError):
        h.copy_d2h(p, out)


def test_a_checked_range_is_refused_after_its_free():
    """_locate remembers the ranges it checked (a decode step asks for the same ones each
    step) only until a free: a twin's read of freed memory still fails, a reused address
    gets its new allocation."""
    from metrale.gpu_runtime.host import LaunchContext
    h = HostBackend()
    p, q = h.alloc(64), h.alloc(64)
    ctx = LaunchContext(h, (1, 1, 1), (1, 1, 1), 0)
    assert ctx.read_addr(p, 64) == int(p) and ctx.read_addr(p, 64) == int(p)
    h.read(q, 16, np.float32)
    h.free(p)
    gone = "not inside|past the end"   # (after another allocation, or none)
    with pytest.raises(KernelError, match=gone):
        ctx.read_addr(p, 64)
    with pytest.raises(KernelError, match=gone):
        h.read(p, 16, np.float32)
    r = h.alloc(32)   # may reuse p's address: checked against r's 32 bytes
    with pytest.raises(KernelError, match="past the end"):
        ctx.read_addr(r, 64)
    assert len(h.read(q, 16, np.float32)) == 16


def test_scratch_buffers_are_aligned_kept_grown_and_per_thread():
    """LaunchContext.scratch (the fused decode twins' rows by address): 64-byte aligned, the
    same buffer for the same slot while it is big enough, a bigger one when asked, its own
    per slot and per thread."""
    import threading
    from metrale.gpu_runtime.host import LaunchContext
    h = HostBackend()
    ctx = LaunchContext(h, (1, 1, 1), (1, 1, 1), 0)
    a = ctx.scratch("x", 100)
    assert a % 64 == 0 and ctx.scratch("x", 60) == a and ctx.scratch("y", 100) != a
    big = ctx.scratch("x", 1 << 20)
    assert big % 64 == 0 and ctx.scratch("x", 1 << 20) == big
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (1 << 20)).from_address(big))[:] = 7
    other = []
    t = threading.Thread(target=lambda: other.append(ctx.scratch("x", 100)))
    t.start()
    t.join()
    assert other[0] not in (big, ctx.scratch("y", 100))   # (a's buffer is gone: x grew)


def test_kernel_launch_calls_twin_and_checks_args():
    h = HostBackend()
    logits = np.array([1, 5, 5, 2], np.float32)
    lp, op = h.alloc(16), h.alloc(4)
    h.copy_h2d(logits, lp)
    k = h.kernel("argmax", "argmax_fp32")
    h.launch(k, (1,), (1024,), 0, 0, (lp, op, np.int32(1), np.int32(4)))
    out = np.zeros(1, np.uint32)
    h.copy_d2h(op, out)
    assert out[0] == 2  # index 1 and 2 tie: the halving tree gives 2
    with pytest.raises(KernelError, match="argument 2 is int"):
        h.launch(k, (1,), (1024,), 0, 0, (lp, op, 1, np.int32(4)))
    with pytest.raises(KernelError, match="1024 threads"):
        h.launch(k, (1,), (2048,), 0, 0, (lp, op, np.int32(1), np.int32(4)))
    with pytest.raises(KernelError, match="no numpy twin"):
        h.kernel("argmax", "does_not_exist")
    assert h.has_module("argmax") and not h.has_module("nope")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_map_blocks_covers_every_item_once_and_raises_the_first_error(threads):
    import threading
    be = HostBackend()
    be._twin_threads = threads     # as on a machine with that many CPUs
    seen, names = [], set()

    def fn(lo, hi):
        seen.extend(range(lo, hi))
        names.add(threading.current_thread().name)
    be.map_blocks(10, 3, fn)
    assert sorted(seen) == list(range(10))
    assert (names == {threading.current_thread().name}) == (threads == 1)
    seen.clear()
    be.map_blocks(2, 5, fn)        # one block: on the calling thread
    assert seen == [0, 1]
    be.map_blocks(0, 4, fn)        # nothing to do
    assert seen == [0, 1]

    def bad(lo, hi):
        seen.append(lo)
        if lo == 3:
            raise KernelError("block 3")
    seen.clear()
    with pytest.raises(KernelError, match="block 3"):
        be.map_blocks(9, 3, bad)
    # threaded, every block finishes before the error is raised; inline it stops there
    assert sorted(seen) == ([0, 3] if threads == 1 else [0, 3, 6])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_map_blocks_in_a_forked_child_gets_threads_of_its_own():
    be = HostBackend()
    be._twin_threads = 2
    be.map_blocks(4, 1, lambda lo, hi: None)      # the parent's pool exists now
    pid = os.fork()
    if pid == 0:                                  # child: must not wait on dead threads
        out = []
        be.map_blocks(4, 1, lambda lo, hi: out.append(lo))
        os._exit(0 if sorted(out) == [0, 1, 2, 3] else 1)
    import time
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("map_blocks in a forked child waited on the parent's threads")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0


def test_graph_capture_replays_with_current_buffer_contents():
    h = HostBackend()
    lp, op = h.alloc(4 * 4), h.alloc(4)
    h.begin_capture(0)
    argmax.argmax_fp32(h, 0, lp, op, 1, 4)
    with pytest.raises(DeviceError):
        h.alloc(4)          # allocation during capture is refused
    with pytest.raises(DeviceError):
        h.copy_h2d(np.zeros(1, np.float32), lp)   # sync copies are illegal in capture
    g = h.end_capture(0)
    out = np.zeros(1, np.uint32)
    for row, want in (([0, 9, 1, 2], 1), ([7, 1, 1, 8], 3)):
        h.copy_h2d(np.array(row, np.float32), lp)
        h.launch_graph(g, 0)
        h.copy_d2h(op, out)
        assert out[0] == want
    h.destroy_graph(g)


def test_events_and_streams():
    h = HostBackend()
    s = h.create_stream()
    e0, e1 = h.create_event(), h.create_event()
    h.record_event(e0, s)
    h.record_event(e1, s)
    h.stream_wait_event(h.default_stream(), e1)
    h.event_synchronize(e1)
    assert h.event_query(e1) and h.event_elapsed_ms(e0, e1) >= 0
    assert h.sm_count() >= 1 and h.total_memory() >= h.free_memory() > 0


def test_memory_limit():
    h = HostBackend(memory_limit_bytes=100)
    h.alloc(60)
    with pytest.raises(DeviceError, match="out of memory"):
        h.alloc(60)


def test_backend_selection(monkeypatch, caplog):
    assert isinstance(backend("cpu"), HostBackend)
    monkeypatch.setenv("METRALE_DEVICE", "cpu")
    assert isinstance(backend("auto"), HostBackend)
    monkeypatch.delenv("METRALE_DEVICE")
    with pytest.raises(InvalidArgument):
        backend("tpu")
    from metrale.gpu_runtime import cuda_available
    if not cuda_available()[0]:
        with caplog.at_level(logging.INFO, logger="metrale"):
            assert isinstance(backend("auto"), HostBackend)
        assert any("HostBackend" in r.message for r in caplog.records)
        with pytest.raises(DeviceError):
            backend("cuda:0")


@pytest.mark.gpu
def test_cuda_backend_basics(cuda):
    p = cuda.alloc(64)
    src = np.arange(16, dtype=np.float32)
    cuda.copy_h2d(src, p)
    out = np.zeros(16, np.float32)
    cuda.copy_d2h(p, out)
    assert np.array_equal(out, src)
    s = cuda.create_stream()
    e0, e1 = cuda.create_event(), cuda.create_event()
    cuda.record_event(e0, s)
    cuda.memset_async(p, 0, 64, s)
    cuda.record_event(e1, s)
    cuda.event_synchronize(e1)
    assert cuda.event_elapsed_ms(e0, e1) >= 0
    cuda.copy_d2h(p, out)
    assert np.all(out == 0)
    assert cuda.sm_count() > 0 and cuda.total_memory() > 0
    before = cuda.live_bytes()
    cuda.free(p)
    assert cuda.live_bytes() == before - 64


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(cuda, host):
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 4097)).astype(np.float32)
    lp, op = cuda.alloc(rows.nbytes), cuda.alloc(16)
    s = cuda.default_stream()
    cuda.copy_h2d(rows, lp)
    argmax.argmax_fp32(cuda, s, lp, op, 4, 4097)   # warm-up outside capture
    cuda.begin_capture(s)
    argmax.argmax_fp32(cuda, s, lp, op, 4, 4097)
    g = cuda.end_capture(s)
    rows2 = rng.standard_normal((4, 4097)).astype(np.float32)
    cuda.copy_h2d(rows2, lp)
    cuda.launch_graph(g, s)
    cuda.synchronize(s)
    out = np.zeros(4, np.uint32)
    cuda.copy_d2h(op, out)
    assert np.array_equal(out, argmax.argmax_rule(rows2))


def test_emulator_poisons_in_tests_and_under_the_sanitizer(monkeypatch):
    from metrale.gpu_runtime.emu import EmuBackend
    assert EmuBackend().poison                    # the test suite's METRALE_POISON_MEMORY
    monkeypatch.delenv("METRALE_POISON_MEMORY")
    assert not EmuBackend().poison and EmuBackend(poison=True).poison
