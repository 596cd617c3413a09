"""Benchmark JSONs record paths relative to the repository, not the machine they ran on
(issue 44): committed results hold no absolute home, work or temporary directories, and
`recorded_path` is the one rule the scripts use."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from metrale.bench.env import recorded_path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r'[" =](/(root|home|tmp|work|Users|mnt|opt)/|[A-Z]:\\\\)')


def test_committed_results_record_no_machine_paths():
    results = sorted((ROOT / "benchmarks" / "results").glob("*"))
    assert results
    bad = [f"{p.name}: {m.group(0)}" for p in results
           for m in [MACHINE_PATH.search(p.read_text(errors="replace"))] if m]
    assert not bad, bad


def test_recorded_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert recorded_path(tmp_path / "models" / "m.gguf") == "models/m.gguf"
    assert recorded_path("models/m.gguf") == "models/m.gguf"
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path / "models")
    assert recorded_path(tmp_path / "cache" / "test-models" / "x.gguf") == \
        "<metrale cache>/test-models/x.gguf"
    assert recorded_path("/elsewhere/on/this/box/w.safetensors") == "w.safetensors"
    assert recorded_path(sys.executable) == "python"
