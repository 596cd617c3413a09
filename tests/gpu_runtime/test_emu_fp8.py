"""The emulator's FP8 / FP16 conversions (metrale/gpu_runtime/emu/fp16_fp8.h) on every code,
against the float8_e4m3fn / e5m2 / IEEE half definitions written out here, and against
NVIDIA's own cuda_fp8.hpp compiled as host code where a CUDA toolkit is installed."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from metrale.gpu_runtime.emu import EmuBackend
from metrale.ops.gemm_q import e4m3_table
from tests.conftest import emu_available
from tests.helpers import Buffers

pytestmark = pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
KERNELS = Path(__file__).resolve().parent / "emu_kernels" / "fp8_convert.cu"


def e4m3_value(code: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is 0 or a
    subnormal m * 2^-9; S.1111.111 is NaN; there are no infinities."""
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    return s * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def e5m2_value(code: int) -> float:
    """float8_e5m2: the upper byte of an IEEE half."""
    return float(np.array([code << 8], np.uint16).view(np.float16)[0])


def half_bits(v: float) -> int:
    return int(np.array([v], np.float16).view(np.uint16)[0])


@pytest.fixture(scope="module")
def codes():
    be = EmuBackend()
    lib = be.load_source(KERNELS)
    with Buffers(be) as b:
        outs = [b.empty((256,), np.uint16) for _ in range(4)] + [b.empty((256,), np.float32)]
        be.launch(be.kernel_from(lib, "fp8_codes"), (2,), (128,), 0, 0, tuple(outs))
        got = [b.get(p, (256,), np.uint16) for p in outs[:4]]
        got.append(b.get(outs[4], (256,), np.float32))
    return dict(zip(("e4m3", "lo", "hi", "e5m2", "f32"), got))


def test_e4m3_to_half_on_every_code(codes):
    for c in range(256):
        v = e4m3_value(c)
        got = int(codes["e4m3"][c])
        if np.isnan(v):
            assert got == 0x7FFF, hex(c)   # the canonical FP16 NaN, sign dropped
        else:
            assert got == half_bits(v), (hex(c), hex(got), v)
    # the corner cases by name: -0, the smallest subnormals, the largest normal
    assert codes["e4m3"][0x80] == 0x8000 and codes["e4m3"][0x00] == 0x0000
    assert codes["e4m3"][0x01] == half_bits(2.0**-9) and codes["e4m3"][0x07] == half_bits(7 * 2.0**-9)
    assert codes["e4m3"][0x7E] == half_bits(448.0) and codes["e4m3"][0xFE] == half_bits(-448.0)


def test_pairs_and_the_float_view_agree(codes):
    assert np.array_equal(codes["lo"], codes["e4m3"])
    assert np.array_equal(codes["hi"], codes["e4m3"][::-1])
    want = e4m3_table()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(codes["f32"]), nan)
    assert np.array_equal(codes["f32"][~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_e5m2_to_half_on_every_code(codes):
    for c in range(256):
        v = e5m2_value(c)
        got = int(codes["e5m2"][c])
        assert got == (0x7FFF if np.isnan(v) else c << 8), hex(c)


def test_half_to_float_on_every_code():
    be = EmuBackend()
    lib = be.load_source(KERNELS)
    with Buffers(be) as b:
        out, pairs = b.empty((65536,), np.float32), b.empty((65536, 2), np.float32)
        be.launch(be.kernel_from(lib, "half_codes"), (256,), (256,), 0, 0, (out, pairs))
        got, got2 = b.get(out, (65536,), np.float32), b.get(pairs, (65536, 2), np.float32)
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.array_equal(got2[:, 0].view(np.uint32), got.view(np.uint32))
    assert np.array_equal(got2[:, 1].view(np.uint32), got[::-1].view(np.uint32))


def _cuda_include() -> str | None:
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and (Path(d) / "include" / "cuda_fp8.h").is_file() and \
                (Path(d) / "include" / "crt" / "host_defines.h").is_file():
            return str(Path(d) / "include")
    return None


def test_same_bits_as_nvidias_cuda_fp8_hpp(codes, tmp_path):
    """cuda_fp8.hpp's own __nv_cvt_fp8_to_halfraw (its host path: the sm_80 device path too)
    on all 256 codes of both formats."""
    inc = _cuda_include()
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if inc is None or cxx is None:
        pytest.skip("no CUDA toolkit headers (crt/host_defines.h) for a host build")
    src = tmp_path / "ref.cpp"
    src.write_text('#include <cuda_fp8.h>\n#include <cstdio>\nint main() {\n'
                   '  for (int c = 0; c < 256; ++c) std::printf("%u %u\\n",\n'
                   '    __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3).x,\n'
                   '    __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E5M2).x);\n}\n')
    exe = tmp_path / "ref"
    proc = subprocess.run([cxx, "-std=c++17", f"-I{inc}", str(src), "-o", str(exe)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cuda_fp8.h does not build as host code here: {proc.stderr[-300:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    ref = np.array([[int(v) for v in line.split()] for line in out.splitlines()], np.uint16)
    assert np.array_equal(ref[:, 0], codes["e4m3"])
    assert np.array_equal(ref[:, 1], codes["e5m2"])
