"""kernel_source: entry points from the preprocessed source, the inline-asm rule, and that
every kernel has a numpy twin (the HostBackend runs every launch through one)."""
import pytest

import metrale.ops  # noqa: F401  (registers every twin)
from metrale.gpu_runtime import kernel_source, twins
from tests.conftest import emu_available

pytestmark = pytest.mark.skipif(not emu_available(), reason="needs a C++ preprocessor")


def test_macro_generated_entry_points_are_found():
    names = kernel_source.entry_points("attention")
    assert "prefill_attention_p4" in names and "decode_attention_v2_g8" in names
    assert "decode_attention_combine" in names and "__launch_bounds__" not in names


def test_every_entry_point_has_a_twin():
    missing = [(f.stem, n) for f in kernel_source.kernel_files()
               for n in kernel_source.entry_points(f.stem) if twins.lookup(f.stem, n) is None]
    assert not missing


GUARDED = """
__device__ uint4 ld(const void *p) {
#ifdef __CUDA_ARCH__
    uint4 v; asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x) : "l"(p)); return v;
#else
    return *(const uint4 *)p;
#endif
}
"""


@pytest.mark.parametrize("text,problem", [
    (GUARDED, None),
    (GUARDED.replace("#ifdef __CUDA_ARCH__", "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800"),
     None),
    ('// asm("not code")\n/* asm volatile("x") */\nint x;', None),
    ('__device__ void f() { asm volatile("membar.gl;"); }', "line 1: inline asm outside"),
    (GUARDED.replace("#else\n    return *(const uint4 *)p;\n", ""), "has no #else"),
    (GUARDED.replace("#ifdef __CUDA_ARCH__", "#ifndef __CUDA_ARCH__"), "outside an #ifdef"),
])
def test_inline_asm_needs_a_cuda_arch_guard_and_a_fallback(text, problem):
    got = kernel_source.unguarded_asm(text)
    if problem is None:
        assert got == []
    else:
        assert len(got) == 1 and problem in got[0]


def test_the_kernels_obey_the_asm_rule():
    for f in kernel_source.kernel_files():
        assert kernel_source.unguarded_asm(f.read_text()) == [], f.name


@pytest.mark.parametrize("arch", kernel_source.ARCHS)
def test_the_tensor_core_wrappers_compile_for_the_gpu(arch):
    # kernels/mma.cuh's device branches (mma.sync, ldmatrix, cp.async), through the test
    # kernels the emulator's tests run: NVRTC, no GPU needed
    pytest.importorskip("cuda.bindings.nvrtc")
    from pathlib import Path
    src = Path(__file__).resolve().parent / "emu_kernels" / "tensor_core.cu"
    _, log = kernel_source.compile_cubin(src, arch)
    stats = {k["name"]: k for k in kernel_source.parse_ptxas(log)}
    assert {"mma_direct", "ldmatrix_check", "tc_gemm"} <= set(stats)
    assert all(k["spill_stores"] == 0 for k in stats.values())
