"""Shared fixtures and THE tolerance table of the test suite.

Widen a tolerance only with a comment saying why.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from metrale.gpu_runtime import HostBackend, backend, cuda_available

# Every HostBackend / EmuBackend the tests make fills fresh memory with 0xFF (NaN), so a
# kernel or twin that reads memory nobody wrote gives NaN and fails its test; users' loads
# get lazily zeroed pages instead (gpu_runtime/host_memory.py).
os.environ.setdefault("METRALE_POISON_MEMORY", "1")

# name -> (rtol, atol). Twins compute in FP32 and round every stored activation to BF16,
# like the kernels, so "twin vs float64 formula" is bounded by a few BF16 ulps (2^-8 rel).
TOL = {
    # twin (FP32 math, BF16 store) against a float64 formula rounded once to BF16
    "twin_bf16": (1e-2, 1e-2),
    # twin output kept in FP32 against float64
    "twin_fp32": (1e-5, 1e-5),
    # GPU kernel against its twin: different summation order in FP32 can move a BF16
    # result across one rounding boundary, i.e. one BF16 ulp (2^-7 relative) at worst.
    "gpu_vs_twin_bf16": (1.6e-2, 1e-2),
    "gpu_vs_twin_fp32": (1e-4, 1e-4),
    # whole model against golden HF fp32 logits: the bound is relative max error
    # well under 4% of max |logit|; BF16 activations give ~1% on the tiny fixtures.
    "model_vs_golden_rel_max": (0.04, 0.0),
    # whole model on a device backend (the kernels) against HostBackend (the twins): per
    # kernel at most one BF16 ulp apart (gpu_vs_twin_bf16), compounding over the layers; on
    # the GPU fast-math exp/rsqrt and FMA contraction add to it. Measured on emu: 0 to 2.4e-6.
    "model_device_vs_host_rel_max": (0.05, 0.0),
    # recurrent layers (gated delta rule, Mamba2 scan), as max |a - e| / max |e| over a whole
    # output: BF16 outputs of a kernel or twin against FP32 results of the same math (the
    # twin, HF's torch reference run in float32) differ by one BF16 rounding (2^-8 of the
    # largest value), FP32 states by float32 noise (measured: outputs <= 2.7e-3 against HF,
    # <= 3.5e-4 kernel against twin; states <= 5e-7). Per-element rtol/atol would hide a
    # wrong small term (e.g. the k.q product of the decode step).
    "recurrent_bf16_rel_max": (2.0 ** -8, 0.0),
    "recurrent_state_rel_max": (1e-5, 0.0),
}


def assert_close(actual, expected, kind: str, msg: str = "") -> None:
    rtol, atol = TOL[kind]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol, err_msg=msg)


def rel_max_error(actual, expected) -> float:
    """max |a - e| / max |e| (the model-level metric of the issues)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-12))


_GPU = None


def gpu_available() -> bool:
    global _GPU
    if _GPU is None:
        _GPU = cuda_available()[0]
    return _GPU


def emu_available() -> bool:
    return shutil.which(os.environ.get("CXX") or "g++") is not None


def device_backends() -> list[str]:
    """What the `device` fixture runs `gpu` tests on.

    METRALE_DEVICE=emu or =cuda[:N] picks one; otherwise every backend that can run the
    CUDA sources here: "emu" (the kernels compiled with g++, needs a C++ compiler) and
    "cuda" (needs a usable GPU).
    """
    env = (os.environ.get("METRALE_DEVICE") or "").strip().lower()
    if env == "emu" or env.startswith("cuda"):
        return [env]
    return [name for name, ok in (("emu", emu_available()), ("cuda", gpu_available())) if ok]


def pytest_runtest_logstart(nodeid, location):
    """METRALE_TEST_MARKER=FILE: the id of the test now running, written before it starts.
    Under AddressSanitizer a failure aborts the process inside pytest's output capture,
    so the report goes to a file (ASAN_OPTIONS=log_path) and CI names the test from this
    marker (.ci/run, run_sanitized)."""
    path = os.environ.get("METRALE_TEST_MARKER")
    if path:
        with open(path, "w") as f:
            f.write(nodeid + "\n")


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", device_backends(), indirect=True)


# The size knob of the `gpu` tests: parameters marked `real_size` (real-model shapes, e.g. a
# 128256 x 4096 lm_head) run on a GPU only. The emulator runs every kernel body at the
# ragged sizes, which reach the same code paths, in CI time; METRALE_EMU_REAL_SIZES=1 runs
# the real shapes on it too.
REAL_SIZE = pytest.mark.real_size


def real(*values):
    """A parametrize entry that is a real-model shape (GPU only unless asked for)."""
    return pytest.param(*values, marks=REAL_SIZE)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no usable CUDA GPU")
    skip_dev = pytest.mark.skip(reason="no device backend (no GPU, no C++ compiler for emu)")
    skip_real = pytest.mark.skip(reason="real-model size: GPU only on the emulator "
                                        "(METRALE_EMU_REAL_SIZES=1 runs it)")
    emu_real = os.environ.get("METRALE_EMU_REAL_SIZES", "0") not in ("", "0")
    for item in items:
        if "gpu" not in item.keywords:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        on = params.get("device", params.get("device_name"))  # a test's backend parameter
        if on == "emu" or "device" in getattr(item, "fixturenames", ()):
            if not device_backends():
                item.add_marker(skip_dev)
            if on == "emu" and "real_size" in item.keywords and not emu_real:
                item.add_marker(skip_real)
        elif not gpu_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def host():
    return HostBackend()


@pytest.fixture
def cuda():
    """A CudaBackend: for tests of CUDA itself (streams, graphs, compute-sanitizer)."""
    if not gpu_available():
        pytest.skip("no usable CUDA GPU")
    from metrale.gpu_runtime import CudaBackend
    return CudaBackend(0)


@pytest.fixture
def device(request):
    """A backend that runs the real kernels: EmuBackend on the CPU, or CudaBackend."""
    return backend(request.param)


def on_emu(backend_) -> bool:
    """Whether kernels run emulated (the size knob: real-model shapes only on a GPU)."""
    return backend_.name == "emu"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
