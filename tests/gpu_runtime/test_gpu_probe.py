"""`--device auto` without a GPU: cheap facts rule the GPU out before CuPy is imported
(importing CuPy costs 1.1-1.4 s of CPU, a third of a CPU start-up; issue 44)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import metrale.gpu_runtime as gr


@pytest.fixture
def gpu_machine(monkeypatch):
    """Every cheap fact says a GPU may be there (device nodes, a driver library)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gr, "_nvidia_device_nodes", lambda: ["nvidiactl", "nvidia0"])
    monkeypatch.setattr(gr.ctypes, "CDLL", lambda name: object())
    return monkeypatch


def test_a_machine_that_may_have_a_gpu_asks_cupy(gpu_machine):
    assert gr.gpu_ruled_out() == ""


@pytest.mark.parametrize("visible", ["", "-1", "NoDevFiles"])
def test_cuda_visible_devices_hiding_every_gpu(gpu_machine, visible):
    gpu_machine.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert "CUDA_VISIBLE_DEVICES" in gr.gpu_ruled_out()
    gpu_machine.setenv("CUDA_VISIBLE_DEVICES", "1")   # a GPU chosen, not hidden
    assert gr.gpu_ruled_out() == ""


def test_no_device_node(gpu_machine):
    gpu_machine.setattr(gr, "_nvidia_device_nodes", lambda: [])
    if sys.platform.startswith("linux"):
        assert "device node" in gr.gpu_ruled_out()


def test_no_driver_library(gpu_machine):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    gpu_machine.setattr(gr.ctypes, "CDLL", missing)
    assert "driver library" in gr.gpu_ruled_out()


def test_ruled_out_means_no_cupy_import(gpu_machine):
    gpu_machine.setenv("CUDA_VISIBLE_DEVICES", "")
    gpu_machine.delitem(sys.modules, "cupy", raising=False)
    ok, why = gr.cuda_available()
    assert not ok and "CUDA_VISIBLE_DEVICES" in why
    assert "cupy" not in sys.modules


def test_device_auto_on_a_cpu_machine_never_imports_cupy():
    """The whole default path, in a fresh process: `metrale generate --device auto` (the
    default) with CUDA hidden runs on the CPU without importing CuPy."""
    code = ("import sys\nfrom metrale.cli import main\n"
            "rc = main(['generate', 'preset:tiny', '--ids', '1,2', '--max-new-tokens', '1'])\n"
            "assert rc == 0, rc\nprint('cupy' in sys.modules)\n")
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("METRALE_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
