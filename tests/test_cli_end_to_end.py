"""End to end through the `metrale` script on the fixtures (issue 14, Done when):
`generate --chat`, `ppl`, `embed`, `transcribe` of a stereo 44.1 kHz float WAV and `info`,
each run as a user runs it (a subprocess) and its output checked."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_cli_paths import FIXTURES, checkpoint

ROOT = Path(__file__).resolve().parents[1]


def run_metrale(*argv, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    device = [] if argv[0] == "info" else ["--device", "cpu"]
    p = subprocess.run([sys.executable, "-m", "metrale.cli", *map(str, argv), *device],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert p.returncode == 0, (argv, p.stderr)
    return p


def stereo_float_wav(path: Path, seconds=1.5, rate=44100) -> None:
    """IEEE float 32-bit, 2 channels, 44.1 kHz: what an editor exports."""
    t = np.arange(int(rate * seconds)) / rate
    x = np.stack([0.4 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)], 1)
    data = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 2, rate, rate * 8, 8, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + \
        struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    return {"tmp": tmp, "llama": checkpoint(tmp, "llama_gqa"),
            "whisper": checkpoint(tmp, "whisper_tiny")}


def test_generate_chat(work):
    p = run_metrale("generate", work["llama"], "--chat", "--prompt", "Hello é 中文",
                    "--max-new-tokens", "12", "--ignore-eos", cwd=work["tmp"])
    import metrale
    from metrale.engine import apply_chat_template, generate
    from tokenizers import Tokenizer
    ids = apply_chat_template(work["llama"], [{"role": "user", "content": "Hello é 中文"}])
    tokens = generate(metrale.load(work["llama"], "cpu", progress=False), ids, 12,
                      stop_token_ids=[]).tokens
    tok = Tokenizer.from_file(str(work["llama"] / "tokenizer.json"))
    assert p.stdout == tok.decode(tokens) + "\n"
    assert f"12 tokens (length); {len(ids)} prompt tokens; greedy" in p.stderr


def test_ppl_of_a_text_file(work):
    text = work["tmp"] / "t.txt"
    text.write_text("the cat sat on the mat, and the dog sat on the log. " * 4 + "é 中文 🙂\n")
    d = json.loads(run_metrale("ppl", work["llama"], "--text", text, "--window", "32", "--json",
                           cwd=work["tmp"]).stdout)
    assert d["tokens_scored"] == d["tokens"] - 1 and d["tokens"] > 32
    assert 1 < d["perplexity"] < 1e6 and d["windows"] > 1


def test_embed_texts(work):
    vecs = json.loads(run_metrale("embed", work["llama"], "--text", "é", "--text", "中文 🙂",
                                  "--json", cwd=work["tmp"]).stdout)
    assert [v["input"] for v in vecs] == ["é", "中文 🙂"]
    assert all(abs(v["norm"] - 1) < 1e-4 and len(v["vector"]) == 64 for v in vecs)


def test_transcribe_a_stereo_float_wav(work):
    wav = work["tmp"] / "stereo.wav"
    stereo_float_wav(wav)
    d = json.loads(run_metrale("transcribe", work["whisper"], wav, "--language", "de",
                               "--task", "translate", "--max-new-tokens", "6", "--json",
                           cwd=work["tmp"]).stdout)
    assert d["language"] == "<|de|>" and 1 <= len(d["tokens"]) <= 6
    assert isinstance(d["text"], str) and d["segments"][0]["end"] == pytest.approx(1.5)
    # the tokens are the library's for the same audio, downmixed and resampled
    import metrale
    from metrale.engine.transcribe import transcribe
    want = transcribe(metrale.load(FIXTURES / "whisper_tiny", "cpu", progress=False),
                      metrale.audio.load_wav(wav), language="de", task="translate",
                      max_new_tokens=6)
    assert d["tokens"] == want.tokens


def test_info_runs(work):
    p = run_metrale("info", work["llama"], cwd=work["tmp"])
    assert "llama" in p.stdout and "tokenizer.json" in p.stdout
