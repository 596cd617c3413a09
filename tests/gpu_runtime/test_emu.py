"""EmuBackend: the CUDA execution model on fibers, checked against the CUDA documentation's
rules (written out here independently of the shim), its diagnostics, its launch checks, its
modes (shuffled order, AddressSanitizer) and its build cache."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import DeviceError, InvalidArgument, KernelError
from metrale.gpu_runtime import DevicePtr, backend
from metrale.gpu_runtime.emu import EmuBackend
from metrale.gpu_runtime.emu.build import build_library, rewrite_dynamic_shared
from tests.conftest import emu_available
from tests.helpers import Buffers

pytestmark = pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
HERE = Path(__file__).resolve().parent / "emu_kernels"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emu():
    return EmuBackend()


def launch(be, lib, func, grid, block, args, shared=0):
    be.launch(be.kernel_from(lib, func), grid, block, shared, 0, args)


# --------------------------------------------------------------------- warp intrinsics
def shfl_reference(op: str, lane: int, b: int, width: int) -> int:
    """The CUDA Programming Guide's wording of each shuffle (a lane reads its own value when
    the source falls outside what the variant allows)."""
    base = lane - lane % width
    if op == "idx":
        return base + b % width
    if op == "up":
        return lane - b if lane % width >= b else lane
    if op == "down":
        return lane + b if lane % width + b < width else lane
    src = lane ^ b  # xor: lanes of earlier groups may be read, later ones not
    return src if src < base + width else lane


@pytest.mark.parametrize("op,code", [("idx", 0), ("up", 1), ("down", 2), ("xor", 3)])
@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
def test_shuffles_follow_the_cuda_rules(emu, op, code, width):
    lib = emu.load_source(HERE / "warp_rules.cu")
    params = [0, 1, 3, width - 1, width, 5, 17, 31] if op in ("idx", "xor") else [0, 1, 2, 5, 16]
    with Buffers(emu) as b:
        out = b.empty((64,), np.int32)
        for p in params:
            launch(emu, lib, "shuffle", (1,), (64,),
                   (out, np.int32(code), np.int32(p), np.int32(width)))
            got = b.get(out, (64,), np.int32)
            want = [1000 * (32 * (t // 32) + shfl_reference(op, t % 32, p, width)) + 7
                    for t in range(64)]
            assert list(got) == want, (op, p, width)


def test_votes_and_match(emu, rng):
    lib = emu.load_source(HERE / "warp_rules.cu")
    pred = rng.integers(0, 3, size=64).astype(np.int32)
    pred[32:] = 1  # second warp: all true
    with Buffers(emu) as b:
        out = b.empty((256,), np.uint32)
        launch(emu, lib, "votes", (1,), (64,), (out, b.put(pred)))
        got = b.get(out, (64, 4), np.uint32)
    for t in range(64):
        w = pred[32 * (t // 32): 32 * (t // 32) + 32]
        ballot = sum(1 << i for i in range(32) if w[i])
        match = sum(1 << i for i in range(32) if w[i] == pred[t])
        assert list(got[t]) == [ballot, int(w.any()), int(w.all()), match]


def test_reduce_and_syncthreads_count(emu, rng):
    lib = emu.load_source(HERE / "warp_rules.cu")
    vals = rng.integers(-1000, 1000, size=96).astype(np.int32)
    pred = (rng.random(96) < 0.3).astype(np.int32)
    with Buffers(emu) as b:
        out = b.empty((288,), np.int32)
        launch(emu, lib, "reduce", (1,), (96,), (out, b.put(vals)))
        red = b.get(out, (96, 3), np.int32)
        launch(emu, lib, "count", (1,), (96,), (out, b.put(pred)))
        cnt = b.get(out, (96, 3), np.int32)
    for t in range(96):
        w = vals[32 * (t // 32): 32 * (t // 32) + 32]
        assert list(red[t]) == [w.sum(), w.min(), w.max()]
        assert list(cnt[t]) == [pred.sum(), int(pred.all()), int(pred.any())]


def test_half_warp_masks_complete_independently(emu):
    lib = emu.load_source(HERE / "warp_rules.cu")
    with Buffers(emu) as b:
        out = b.empty((32,), np.int32)
        launch(emu, lib, "half_masks", (1,), (32,), (out,))
        assert list(b.get(out, (32,), np.int32)) == [t ^ 1 for t in range(32)]


# --------------------------------------------------------------------- diagnostics
@pytest.mark.parametrize("func,block,message", [
    ("divergent_barrier", 64, r"different barriers: thread \d+ at __syncthreads \(bugs.cu:7\), "
                              r"thread \d+ at __syncthreads \(bugs.cu:10\)"),
    ("exited_lane", 32, r"mask 0xffffffff, which names lane 0 that has exited"),
    ("warp_vs_block", 32, r"waits at __shfl_sync \(bugs.cu:\d+\) for lane 0, which waits at "
                          r"__syncthreads"),
    ("divergent_warp", 32, r"divergent warp intrinsics"),
    ("outside_mask", 32, r"reads lane 20, which is not in the mask 0x0000ffff"),
    ("traps", 32, r"thread \(5,0,0\): __trap\(\) at bugs.cu:\d+"),
])
def test_bugs_are_reported_with_file_and_line(emu, func, block, message):
    lib = emu.load_source(HERE / "bugs.cu")
    with Buffers(emu) as b:
        out = b.empty((block,), np.int32)
        with pytest.raises(KernelError, match=message) as e:
            launch(emu, lib, func, (2,), (block,), (out,))
    assert f"bugs.{func} block (0,0,0)" in str(e.value)
    # the library stays usable after an abandoned launch
    with Buffers(emu) as b:
        out = b.empty((64,), np.float32)
        launch(emu, lib, "correct_sum", (1,), (64,), (out, b.put(np.ones(64, np.float32))))
        assert b.get(out, (1,), np.float32)[0] == 64


def test_shuffled_order_exposes_a_missing_barrier():
    x = np.arange(1, 65, dtype=np.float32)
    results = {}
    for order in ("forward", "reverse", "shuffle:1", "shuffle:2"):
        be = EmuBackend(order=order)
        lib = be.load_source(HERE / "bugs.cu")
        with Buffers(be) as b:
            out, xp = b.empty((1,), np.float32), b.put(x)
            launch(be, lib, "correct_sum", (1,), (64,), (out, xp))
            assert b.get(out, (1,), np.float32)[0] == x.sum(), order
            launch(be, lib, "racy_sum", (1,), (64,), (out, xp))
            results[order] = float(b.get(out, (1,), np.float32)[0])
    # forward runs thread 0 first: it reads 63 unwritten (NaN) slots; reverse runs it last
    assert np.isnan(results["forward"]) and results["reverse"] == x.sum()
    assert len({str(v) for v in results.values()}) > 1


def test_unwritten_shared_memory_reads_nan(emu):
    lib = emu.load_source(HERE / "bugs.cu")
    with Buffers(emu) as b:
        out = b.empty((2,), np.uint32)
        launch(emu, lib, "unwritten_shared", (1,), (32,), (out,), shared=16)
        assert list(b.get(out, (2,), np.uint32)) == [0xFFFFFFFF, 0xFFFFFFFF]


# --------------------------------------------------------------------- launch checks
def test_arguments_are_checked_against_the_c_signature(emu):
    lib = emu.load_source(HERE / "bugs.cu")
    k = emu.kernel_from(lib, "typed")
    assert [p.c_type for p in k.impl.params] == [
        "float*", "const __nv_bfloat16*", "int", "unsigned int", "long long int", "float"]
    with Buffers(emu) as b:
        out, x = b.empty((1,), np.float32), b.put(np.array([0x3F80], np.uint16))
        good = [out, x, np.int32(1), np.uint32(2), np.int64(3), np.float32(0.5)]
        emu.launch(k, (1,), (1,), 0, 0, good)
        assert b.get(out, (1,), np.float32)[0] == 7.5
        bad = [
            (2, np.int64(1), r"argument 2 \(int\) must be np.int32, got int64"),
            (3, np.int32(2), r"argument 3 \(unsigned int\) must be np.uint32"),
            (5, np.int32(0), r"argument 5 \(float\) must be np.float32"),
            (0, np.int32(0), r"argument 0 \(float\*\) must be a DevicePtr"),
            (1, x.offset(1), r"argument 1 .* is not 2-byte aligned"),
            (0, DevicePtr(8), r"argument 0 .* is not inside any live allocation"),
        ]
        for i, value, msg in bad:
            args = list(good)
            args[i] = value
            with pytest.raises(KernelError, match=msg):
                emu.launch(k, (1,), (1,), 0, 0, args)
        with pytest.raises(KernelError, match="5 arguments for 6 parameters"):
            emu.launch(k, (1,), (1,), 0, 0, good[:5])
        with pytest.raises(KernelError, match="dynamic shared memory"):
            emu.launch(k, (1,), (1,), 48 * 1024 + 4, 0, good)
        with pytest.raises(KernelError, match="grid.y = 65536 exceeds"):
            emu.launch(k, (1, 65536), (1,), 0, 0, good)
        with pytest.raises(KernelError, match="does not exist"):
            emu.kernel_from(lib, "no_such_kernel")


def test_backend_selection_and_modes(monkeypatch):
    monkeypatch.setenv("METRALE_EMU_ORDER", "shuffle:7")
    be = backend("emu")
    assert isinstance(be, EmuBackend) and be.order == 2 and be.name == "emu"
    for spec in ("sideways", "shuffle", "shuffle:x"):
        with pytest.raises(InvalidArgument, match="emu order"):
            EmuBackend(order=spec)
    if "libasan" not in open("/proc/self/maps").read():
        with pytest.raises(DeviceError, match="LD_PRELOAD"):
            EmuBackend(sanitize=True)


def test_dynamic_shared_rewrite_keeps_lines():
    src = "a\nextern __shared__ __align__(16) float smem[];  // x\nb\n"
    out = rewrite_dynamic_shared(src, "t.cu")
    assert out.count("\n") == src.count("\n")
    assert "float *const smem = reinterpret_cast<float *>(::emu::dynamic_smem());" in out
    with pytest.raises(KernelError, match=r"t.cu:1: an `extern __shared__`"):
        rewrite_dynamic_shared("extern __shared__ float a[4];", "t.cu")


def test_build_is_cached_by_content(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int *o) { o[threadIdx.x] = 1; }\n')
    so1, entries = build_library(src)
    assert [e.name for e in entries] == ["k"] and so1.parent == tmp_path / "emu"
    assert (entries[0].file, entries[0].line, entries[0].max_threads) == ("k.cu", 1, None)
    # a build is said on stderr, before and after (first runs compile for minutes)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "metrale: building k.cu for the emulator (first use on this machine; " \
        "cached for later runs)" and re.fullmatch(r"metrale: built k\.cu for the emulator in "
                                                  r"\d+\.\d s", err[1]), err
    assert build_library(src)[0] == so1
    assert capsys.readouterr().err == ""   # the cached library: nothing to say
    src.write_text('extern "C" __global__ void k(int *o) { o[threadIdx.x] = 2; }\n')
    assert build_library(src)[0] != so1
    src.write_text('extern "C" __global__ void k(int *o) { o[threadIdx.x] = ; }\n')
    with pytest.raises(KernelError, match="k.cu:1"):
        build_library(src)


# --------------------------------------------------------------------- AddressSanitizer
ASAN_SCRIPT = """
import numpy as np, sys
from metrale.gpu_runtime.emu import EmuBackend
from tests.helpers import Buffers
be = EmuBackend(sanitize=True)
lib = be.load_source(sys.argv[1])
with Buffers(be) as b:
    out = b.empty((1,), np.float32)
    if sys.argv[2] == "global":
        x = b.put(np.ones(10, np.float32))
        args, shared = (out, x, np.int32(10)), 0
        be.launch(be.kernel_from(lib, "read_past_end"), (1,), (32,), shared, 0, args)
    else:
        be.launch(be.kernel_from(lib, "shared_past_end"), (1,), (32,), 40, 0,
                  (out, np.int32(10)))
print("NOT DETECTED")
"""


def asan_env():
    lib = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    if not lib or not Path(lib).exists():
        pytest.skip("no libasan")
    return dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
                PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("where,culprit", [("global", "out[0] = x[n];"),
                                           ("shared", "out[0] = s[n];")])
def test_asan_names_the_kernel_line(where, culprit):
    src = (HERE / "bugs.cu").read_text().splitlines()
    want = next(i + 1 for i, s in enumerate(src) if culprit in s)
    proc = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, str(HERE / "bugs.cu"), where],
                          capture_output=True, text=True, env=asan_env(), timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "NOT DETECTED" not in out and proc.returncode != 0, out[-3000:]
    assert "AddressSanitizer" in out and f"bugs.cu:{want}" in out, out[-3000:]


# --------------------------------------------------------------------- tensor cores
def bf16_bits(x):
    from metrale.ops.bf16 import f32_to_bf16
    return f32_to_bf16(np.asarray(x, np.float32))


def bf16_vals(bits):
    from metrale.ops.bf16 import bf16_to_f32
    return bf16_to_f32(bits).astype(np.float64)


def test_mma_m16n8k16_is_a_matrix_product(emu, rng):
    lib = emu.load_source(HERE / "tensor_core.cu")
    a, bt = bf16_bits(rng.standard_normal((16, 16))), bf16_bits(rng.standard_normal((8, 16)))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    with Buffers(emu) as b:
        d = b.empty((16, 8), np.float32)
        launch(emu, lib, "mma_direct", (1,), (32,), (d, b.put(a), b.put(bt), b.put(c)))
        got = b.get(d, (16, 8), np.float32)
    want = bf16_vals(a) @ bf16_vals(bt).T + c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix_fragments_follow_the_ptx_table(emu, rng, trans):
    lib = emu.load_source(HERE / "tensor_core.cu")
    m = rng.integers(0, 2**16, size=(4, 8, 8)).astype(np.uint16)
    with Buffers(emu) as b:
        out = b.empty((32, 4), np.uint32)
        launch(emu, lib, "ldmatrix_check", (1,), (32,), (out, b.put(m), np.int32(trans)))
        got = b.get(out, (32, 4), np.uint32)
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for i in range(4):
            mm = m[i].T if trans else m[i]
            assert got[lane, i] == int(mm[r, c]) | (int(mm[r, c + 1]) << 16), (lane, i)


@pytest.mark.parametrize("m,n,k", [(16, 8, 16), (32, 24, 64), (48, 40, 160)])
def test_a_cp_async_ldmatrix_mma_gemm_matches_numpy(emu, rng, m, n, k):
    lib = emu.load_source(HERE / "tensor_core.cu")
    x, w = bf16_bits(rng.standard_normal((m, k))), bf16_bits(rng.standard_normal((n, k)))
    with Buffers(emu) as b:
        y = b.empty((m, n), np.float32)
        launch(emu, lib, "tc_gemm", (n // 8, m // 16), (32,),
               (y, b.put(x), b.put(w), np.int32(m), np.int32(n), np.int32(k)))
        got = b.get(y, (m, n), np.float32)
    np.testing.assert_allclose(got, bf16_vals(x) @ bf16_vals(w).T, rtol=1e-5, atol=1e-4)


def test_cp_async_lands_at_the_wait_and_zero_fills(emu):
    lib = emu.load_source(HERE / "tensor_core.cu")
    with Buffers(emu) as b:
        out = b.empty((4,), np.float32)
        launch(emu, lib, "cp_async_early_read", (1,), (1,),
               (out, b.put(np.array([1.5, 2.5, 3.5, 4.5], np.float32))))
        got = b.get(out, (4,), np.float32)
    assert got.view(np.uint32)[0] == 0xFFFFFFFF and list(got[1:]) == [1.5, 2.5, 0.0]


@pytest.mark.parametrize("func,message", [
    ("cp_async_never_waited", "exited with 1 cp.async copies it never waited for"),
    ("ldmatrix_from_global", "is not in shared memory"),
    ("cp_async_to_global", "cp.async destination is not shared memory"),
])
def test_tensor_core_misuse_is_reported(emu, func, message):
    lib = emu.load_source(HERE / "tensor_core.cu")
    with Buffers(emu) as b:
        p, q = b.put(np.zeros(256, np.float32)), b.put(np.zeros(256, np.float32))
        args = (p,) if func == "cp_async_never_waited" else (p, q)
        with pytest.raises(KernelError, match=message):
            launch(emu, lib, func, (1,), (32,), args)


def test_depth_first_order_exposes_a_missing_barrier_before_a_refill():
    src = np.arange(4 * 256, dtype=np.float32)
    want = np.array([sum(src[it * 256 + 4 * ((t + 32) % 64)] for it in range(4))
                     for t in range(64)], np.float32)
    for order in ("forward", "reverse", "shuffle:3"):
        be = EmuBackend(order=order)
        lib = be.load_source(HERE / "tensor_core.cu")
        with Buffers(be) as b:
            out, sp = b.empty((64,), np.float32), b.put(src)
            launch(be, lib, "refill", (1,), (64,), (out, sp, np.int32(1)))
            assert np.array_equal(b.get(out, (64,), np.float32), want), order
            launch(be, lib, "refill", (1,), (64,), (out, sp, np.int32(0)))
            racy = b.get(out, (64,), np.float32)
        # breadth-first forward order keeps the warps in step and cannot see this race;
        # depth-first reverse order runs one warp into the other's unread data
        assert np.array_equal(racy, want) == (order == "forward"), order


PYTEST_UNDER_ASAN = """
import numpy as np
from pathlib import Path
from metrale.gpu_runtime.emu import EmuBackend
from tests.helpers import Buffers


def test_fine():
    pass


def test_reads_past_the_end():
    be = EmuBackend(sanitize=True)
    lib = be.load_source(Path({src!r}))
    with Buffers(be) as b:
        out, x = b.empty((1,), np.float32), b.put(np.ones(10, np.float32))
        be.launch(be.kernel_from(lib, "read_past_end"), (1,), (32,), 0, 0,
                  (out, x, np.int32(10)))
"""


def test_asan_report_and_test_name_survive_pytest_capture(tmp_path):
    """What CI's run_sanitized relies on: with log_path the report lands in a file, and the
    conftest marker names the test that was running when the process died."""
    test = tmp_path / "test_under_asan.py"
    test.write_text(PYTEST_UNDER_ASAN.format(src=str(HERE / "bugs.cu")))
    env = asan_env()
    env.update(ASAN_OPTIONS=f"detect_leaks=0:log_path={tmp_path}/asan",
               METRALE_TEST_MARKER=str(tmp_path / "current_test"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", str(test)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    want = next(i + 1 for i, s in enumerate((HERE / "bugs.cu").read_text().splitlines())
                if "out[0] = x[n];" in s)
    assert (tmp_path / "current_test").read_text().strip().endswith(
        "test_under_asan.py::test_reads_past_the_end")
    reports = "".join(p.read_text() for p in tmp_path.glob("asan.*"))
    assert "AddressSanitizer" in reports and f"bugs.cu:{want}" in reports, reports[-3000:]
