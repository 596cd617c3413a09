"""First runs say what they build and emulator checks say what they did (issue 44): the
native CPU library (a minute or more) and each emulator kernel library are announced on
stderr before and after the build, terminal or not; `METRALE_EMU_CHECK` prints one summary
line at exit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from metrale.gpu_runtime import cxx as cxx_module
from metrale.gpu_runtime import native, native_lora, native_recurrent
from metrale.gpu_runtime.emu.check_report import CheckTally

ROOT = Path(__file__).resolve().parents[2]

FAKE_CXX = """#!/bin/sh
# a stand-in compiler: creates the -o target (the build's bookkeeping is what is tested)
out=""
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
[ -n "$out" ] && : > "$out"
exit 0
"""


def test_the_native_library_build_is_said_before_and_after(tmp_path, monkeypatch, capsys):
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setattr(cxx_module, "compiler", lambda: str(cxx))
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    lib = native._build(native.TUNE)
    assert lib.is_file() and lib.parent == tmp_path / "cache" / "host"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("metrale: building the CPU backend's native library (first use on this "
                      "machine; cached for later runs)"), err
    assert re.fullmatch(r"metrale: built the CPU backend's native library in \d+\.\d s",
                        err[1]), err
    assert native._build(native.TUNE) == lib and capsys.readouterr().err == ""


def test_every_host_library_is_cached_per_cpu(tmp_path, monkeypatch):
    # -march=native builds differ per CPU: a cache shared by two machines must not hand one
    # the other's library (the LoRA and recurrent libraries' names once left the CPU out)
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setattr(cxx_module, "compiler", lambda: str(cxx))
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    for mod in (native, native_lora, native_recurrent):
        monkeypatch.setattr(cxx_module, "cpu_identity", lambda flags: "cpu A")
        a = mod._build(mod.TUNE)
        monkeypatch.setattr(cxx_module, "cpu_identity", lambda flags: "cpu B")
        b = mod._build(mod.TUNE)
        assert a.is_file() and b.is_file() and a != b, mod.__name__
        assert mod._build(mod.TUNE) == b


def test_check_tally_summary():
    t = CheckTally()
    t.record("rmsnorm.rmsnorm", ["align", "race"])
    t.record("rmsnorm.rmsnorm", ["align", "race"])
    t.record("argmax.argmax_bf16", ["align", "race"])
    assert t.summary() == ("metrale: emulator checks (align,race) ran on 3 launches of 2 "
                           "kernels: nothing found")
    t.record("argmax.argmax_bf16", ["race"], "race on shared memory at argmax.cu:40\nmore")
    assert t.summary().endswith("1 launch(es) failed, the first: argmax.argmax_bf16: race "
                                "on shared memory at argmax.cu:40")


CHECKED_RUN = """
import numpy as np
from metrale.gpu_runtime import backend
from metrale.ops import argmax
be = backend("emu")
rows = np.arange(2 * 33, dtype=np.float32).reshape(2, 33)
x = be.alloc(rows.nbytes)
be.copy_h2d(rows.tobytes(), x)
out = be.alloc(8)
for _ in range(3):
    argmax.argmax_fp32(be, 0, x, out, 2, 33)
"""


def test_emu_checks_say_at_exit_what_they_ran():
    env = dict(os.environ, METRALE_EMU_CHECK="race,align", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHECKED_RUN], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"metrale: emulator checks \(align,race\) ran on 3 launches of 1 "
                        r"kernels: nothing found", last), out.stderr
    env.pop("METRALE_EMU_CHECK")
    out = subprocess.run([sys.executable, "-c", CHECKED_RUN], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0 and "emulator checks" not in out.stderr, out.stderr
