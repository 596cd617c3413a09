"""The EmuBackend's checks, each proven on a kernel with the bug (emu_kernels/detectors.cu)
next to the correct form it must pass: the shared-memory race detector (barriers,
__syncwarp, shuffles, cp.async, atomics), the cross-block global detector, block orders,
alignment of vector accesses, launch bounds, guard bytes, and the hardware counters."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale.errors import InvalidArgument, KernelError
from metrale.gpu_runtime.emu import EmuBackend
from metrale.gpu_runtime.emu.backend import parse_checks
from tests.conftest import emu_available
from tests.helpers import Buffers

pytestmark = pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
SRC = Path(__file__).resolve().parent / "emu_kernels" / "detectors.cu"


def line_of(text: str) -> int:
    return next(i + 1 for i, s in enumerate(SRC.read_text().splitlines()) if text in s)


@pytest.fixture(scope="module")
def checked():
    be = EmuBackend(checks="all")
    return be, be.load_source(SRC)


@pytest.fixture(scope="module")
def counting():
    be = EmuBackend(count=True)
    return be, be.load_source(SRC)


def run(be_lib, func, grid, block, args, shared=0):
    be, lib = be_lib
    be.launch(be.kernel_from(lib, func), grid, block, shared, 0, args)


# --------------------------------------------------------------------- shared memory
@pytest.mark.parametrize("mode,race", [(0, True), (1, True), (2, False), (3, False)])
def test_warp_synchronous_exchange_needs_syncwarp(checked, mode, race):
    with Buffers(checked[0]) as b:
        out = b.empty((64,), np.int32)
        if race:
            with pytest.raises(KernelError, match=r"shared-memory race \((read after write|write "
                               r"after read)\) on static shared memory `warp_exchange::s` \+ "
                               r"\d+: thread \(\d+,0,0\) (wrote|read) it at detectors.cu:\d+ and "
                               r"thread \(\d+,0,0\) (reads|writes) it at detectors.cu:\d+") as e:
                run(checked, "warp_exchange", (1,), (64,), (out, np.int32(mode)))
            assert f"detectors.cu:{line_of('s[t] = 10 * t;')}" in str(e.value)
            assert f"detectors.cu:{line_of('out[t] = s[t ^ 1]')}" in str(e.value)
        else:
            run(checked, "warp_exchange", (1,), (64,), (out, np.int32(mode)))
            assert list(b.get(out, (64,), np.int32)) == [10 * (t ^ 1) for t in range(64)]


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle:5"])
def test_races_are_found_in_every_thread_order(order):
    be = EmuBackend(checks="race", order=order)
    lib = be.load_source(SRC)
    with Buffers(be) as b:
        out = b.empty((64,), np.int32)
        with pytest.raises(KernelError, match="shared-memory race"):
            be.launch(be.kernel_from(lib, "warp_exchange"), (1,), (64,), 0, 0,
                      (out, np.int32(1)))


def test_write_after_write_and_write_after_read(checked):
    with Buffers(checked[0]) as b:
        out, x = b.empty((64,), np.float32), b.put(np.arange(128, dtype=np.float32))
        with pytest.raises(KernelError, match=r"race \(write after write\).*`same_word::s` \+ 0"):
            run(checked, "same_word", (1,), (32,), (out, np.int32(0)))
        run(checked, "same_word", (1,), (32,), (out, np.int32(1)))
        with pytest.raises(KernelError, match=r"race \((write after read|read after write)\)"):
            run(checked, "refill_without_barrier", (1,), (64,), (out, x, np.int32(0)))
        run(checked, "refill_without_barrier", (1,), (64,), (out, x, np.int32(1)))
        got = b.get(out, (64,), np.float32)
        assert list(got) == [(63 - t) + 64 + (63 - t) for t in range(64)]


@pytest.mark.parametrize("mode,message", [
    (0, r"race \((read after write|write after read)\).*cp_async_visibility::s"),
    (1, None),
    (2, r"used before its cp.async landed: thread \(\d+,0,0\) issued cp.async at "
        r"mma.cuh:\d+ <- detectors.cu:\d+"),
])
def test_cp_async_is_a_write_that_lands_at_the_wait(checked, mode, message):
    with Buffers(checked[0]) as b:
        out, x = b.empty((32,), np.float32), b.put(np.arange(128, dtype=np.float32))
        if message:
            with pytest.raises(KernelError, match=message):
                run(checked, "cp_async_visibility", (1,), (32,), (out, x, np.int32(mode)))
        else:
            run(checked, "cp_async_visibility", (1,), (32,), (out, x, np.int32(mode)))
            assert list(b.get(out, (32,), np.float32)) == [4.0 * ((t + 1) % 32)
                                                           for t in range(32)]


def test_atomics_do_not_race(checked):
    x = np.arange(96, dtype=np.int32)
    with Buffers(checked[0]) as b:
        out = b.empty((8,), np.int32)
        run(checked, "shared_histogram", (1,), (96,), (out, b.put(x)))
        assert list(b.get(out, (8,), np.int32)) == [12] * 8


# --------------------------------------------------------------------- global, blocks
def test_blocks_writing_the_same_bytes_are_reported(checked):
    with Buffers(checked[0]) as b:
        out = b.empty((8,), np.int32)
        run(checked, "blocks_overlap", (8,), (32,), (out, np.int32(0)))
        assert list(b.get(out, (8,), np.int32)) == list(range(8))
        with pytest.raises(KernelError, match=r"global-memory race \(write after write\) "
                           r"between blocks: byte 0 of the allocation at 0x[0-9a-f]+: block "
                           r"\(0,0,0\) thread 0 wrote it at detectors.cu:\d+"):
            run(checked, "blocks_overlap", (8,), (32,), (out, np.int32(1)))
        with pytest.raises(KernelError, match=r"global-memory race \(read after write\)"):
            run(checked, "blocks_overlap", (8,), (32,), (out, np.int32(2)))


def test_block_orders_change_what_a_cross_block_read_sees():
    results = {}
    for order in ("forward", "reverse", "shuffle:1", "shuffle:2"):
        be = EmuBackend(block_order=order)
        lib = be.load_source(SRC)
        with Buffers(be) as b:
            out = b.empty((8,), np.int32)
            be.memset(out, 0, 32)
            be.launch(be.kernel_from(lib, "blocks_overlap"), (8,), (32,), 0, 0,
                      (out, np.int32(2)))
            results[order] = list(b.get(out, (8,), np.int32))
    assert results["forward"] == list(range(1, 9))   # each block saw its predecessor
    assert results["reverse"] == [1] * 8               # none did
    assert results["shuffle:1"] != results["forward"] or results["shuffle:2"] != results["forward"]
    # a seeded order is reproducible
    be = EmuBackend(block_order="shuffle:1")
    lib = be.load_source(SRC)
    with Buffers(be) as b:
        out = b.empty((8,), np.int32)
        be.memset(out, 0, 32)
        be.launch(be.kernel_from(lib, "blocks_overlap"), (8,), (32,), 0, 0, (out, np.int32(2)))
        assert list(b.get(out, (8,), np.int32)) == results["shuffle:1"]


# --------------------------------------------------------------------- alignment
def test_misaligned_vector_loads_and_stores_are_errors(checked):
    x = np.arange(8 * 32 + 16, dtype=np.uint16)
    with Buffers(checked[0]) as b:
        out, xp = b.empty((80,), np.float32), b.put(x)
        run(checked, "vector_access", (1,), (32,), (out, xp, np.int32(8), np.int32(2)))
        with pytest.raises(KernelError, match=r"misaligned 16-byte load at detectors.cu:"
                           rf"{line_of('const uint4 v = *reinterpret_cast')}: address "
                           r"0x[0-9a-f]+ \(byte 8 of the allocation at 0x[0-9a-f]+\) is not "
                           r"a multiple of 16"):
            run(checked, "vector_access", (1,), (32,), (out, xp, np.int32(4), np.int32(0)))
        with pytest.raises(KernelError, match=r"misaligned 8-byte store .*byte 4 of the"):
            run(checked, "vector_access", (1,), (32,), (out, xp, np.int32(0), np.int32(1)))
        with pytest.raises(KernelError, match=r"misaligned 16-byte load .*`misaligned_shared::s` \+ 4"):
            run(checked, "misaligned_shared", (1,), (64,), (out, np.int32(1)))
        run(checked, "misaligned_shared", (1,), (64,), (out, np.int32(4)))


# --------------------------------------------------------------------- launch rules, guards
def test_block_over_launch_bounds_is_an_error(checked):
    with Buffers(checked[0]) as b:
        out = b.empty((128,), np.int32)
        run(checked, "bounded", (1,), (64,), (out,))
        with pytest.raises(KernelError, match=rf"detectors.bounded \(detectors.cu:"
                           rf"{line_of('__launch_bounds__(64) bounded')}\): block of 128 "
                           r"threads is over its __launch_bounds__\(64\)"):
            run(checked, "bounded", (1,), (128,), (out,))
        with pytest.raises(KernelError, match=r"65536 bytes of dynamic shared memory"):
            run(checked, "bounded", (1,), (32,), (out,), shared=65536)


@pytest.mark.parametrize("past", [1, 3, 60])
def test_guard_bytes_name_the_kernel_and_offset(past):
    be = EmuBackend()
    lib = be.load_source(SRC)
    with Buffers(be) as b:
        out = b.empty((10,), np.float32)
        be.launch(be.kernel_from(lib, "write_past"), (1,), (32,), 0, 0,
                  (out, np.int32(10), np.int32(0)))
        with pytest.raises(KernelError, match=rf"kernel detectors.write_past wrote outside an "
                           rf"allocation: byte \+{40 + 4 * (past - 1)} from the start of the "
                           rf"40-byte allocation at 0x[0-9a-f]+ \({4 * (past - 1)} bytes after"):
            be.launch(be.kernel_from(lib, "write_past"), (1,), (32,), 0, 0,
                      (out, np.int32(10), np.int32(past)))
        # reported once, the allocation stays usable
        be.launch(be.kernel_from(lib, "write_past"), (1,), (32,), 0, 0,
                  (out, np.int32(10), np.int32(0)))


def test_check_names_are_validated():
    assert parse_checks("all") == parse_checks("align,race") == 3
    assert parse_checks(None) == parse_checks("") == 0
    with pytest.raises(InvalidArgument, match="emu checks"):
        parse_checks("racy")
    with pytest.raises(InvalidArgument, match="sanitize"):
        EmuBackend(sanitize=True, checks="race")
    with pytest.raises(InvalidArgument, match="emu order"):
        EmuBackend(block_order="upwards")


# --------------------------------------------------------------------- counters
def counters_of(counting, func, grid, block, args):
    be, lib = counting
    be.launch_counters.clear()
    be.launch(be.kernel_from(lib, func), grid, block, 0, 0, args)
    (rec,) = be.launch_counters
    return rec["counters"]


@pytest.mark.parametrize("stride,sectors", [(1, 4), (2, 8), (8, 32)])
def test_global_sectors_per_request(counting, stride, sectors):
    with Buffers(counting[0]) as b:
        y, x = b.empty((128,), np.float32), b.put(np.zeros(128 * 8, np.float32))
        c = counters_of(counting, "strided_copy", (2,), (64,), (y, x, np.int32(stride)))
    assert c["blocks"] == 2 and c["gld_requests"] == 4 and c["gst_requests"] == 4
    assert c["gld_sectors"] == 4 * sectors and c["gst_sectors"] == 16
    assert c["gld_bytes"] == c["gld_unique"] == 4 * 128 and c["gld_ideal"] == 16
    load = next(p for p in c["pcs"] if p["kind"] == "global load")
    assert load["where"].startswith("detectors.cu:") and load["units"] == 4 * sectors
    x_range = next(r for r in c["ranges"] if not r["writable"])
    assert (x_range["ld_bytes"], x_range["ld_sectors"]) == (512, 16 * stride)


def test_a_broadcast_is_one_sector(counting):
    with Buffers(counting[0]) as b:
        y, x = b.empty((64,), np.float32), b.put(np.zeros(2, np.float32))
        c = counters_of(counting, "broadcast_load", (2,), (32,), (y, x))
    assert (c["gld_requests"], c["gld_sectors"], c["gld_ideal"], c["gld_bytes"]) == (2, 2, 2, 256)


def test_vector_accesses_are_one_request(counting):
    with Buffers(counting[0]) as b:
        y, x = b.empty((64, 4), np.uint32), b.put(np.zeros((64, 4), np.uint32))
        c = counters_of(counting, "vector_copy", (1,), (64,), (y, x))
    assert (c["gld_requests"], c["gld_sectors"], c["gld_unique"]) == (2, 32, 1024)
    assert (c["gst_requests"], c["gst_sectors"]) == (2, 32)
    assert c["ranges"][0]["ld_bytes"] + c["ranges"][1]["ld_bytes"] == 1024


@pytest.mark.parametrize("stride,wavefronts", [(1, 1), (2, 2), (32, 32), (33, 1)])
def test_shared_bank_conflicts(counting, stride, wavefronts):
    with Buffers(counting[0]) as b:
        out = b.empty((32,), np.float32)
        c = counters_of(counting, "bank_stride", (1,), (32,), (out, np.int32(stride)))
    load = [p for p in c["pcs"] if p["kind"] == "shared load"]
    assert len(load) == 1 and load[0]["requests"] == 1
    assert (load[0]["units"], load[0]["ideal"]) == (wavefronts, 1)
    assert c["barriers"] == 1


@pytest.mark.parametrize("swizzle,wavefronts", [(0, 16), (1, 4)])
def test_ldmatrix_bank_conflicts(counting, swizzle, wavefronts):
    with Buffers(counting[0]) as b:
        out = b.empty((32,), np.uint32)
        c = counters_of(counting, "ldmatrix_banks", (1,), (32,), (out, np.int32(swizzle)))
    assert (c["ldsm_requests"], c["ldsm_wavefronts"], c["ldsm_ideal"]) == (1, wavefronts, 4)


def test_mma_barrier_and_syncwarp_counts(counting):
    with Buffers(counting[0]) as b:
        out = b.empty((3, 64), np.float32)
        c = counters_of(counting, "mma_loop", (3,), (64,), (out, np.int32(5)))
        assert np.all(b.get(out, (3, 64), np.float32) == 80.0)  # 5 steps of 16 ones
    assert (c["blocks"], c["mma"], c["barriers"], c["syncwarps"]) == (3, 30, 15, 6)


def test_sampled_blocks(counting):
    be, lib = counting
    be.sample_blocks = 3
    try:
        with Buffers(be) as b:
            y, x = b.empty((64 * 10,), np.float32), b.put(np.zeros(64 * 10, np.float32))
            c = counters_of(counting, "strided_copy", (10,), (64,), (y, x, np.int32(1)))
    finally:
        be.sample_blocks = 0
    assert c["blocks"] == 3 and c["gld_requests"] == 6
