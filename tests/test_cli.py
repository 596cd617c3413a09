"""`metrale` CLI: bad arguments exit 2 with one line, MetraleError exits 1 with one line,
and the commands run on the tiny preset (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metrale.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "llama_gqa"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("metrale: error:"), err
    return lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "invalid choice"),
    (["bench"], "metrale bench MODEL"),
    (["bench", "--preset", "tiny", "--batch", "0"], "'0'"),
    (["bench", "--preset", "tiny", "--batch", "x"], "'x'"),
    (["bench", "--preset", "tiny", "--batch", "1,,2"], "comma-separated"),
    (["bench", "--preset", "tiny", "--batch", "2000"], "[1, 1024]"),
    (["bench", "--preset", "tiny", "--prompt-len", "0"], "--prompt-len"),
    (["bench", "--preset", "tiny", "--gen-len", "-3"], "--gen-len"),
    (["bench", "--preset", "nope"], "unknown preset"),
    (["bench", "--preset", "tiny", "--model", "preset:tiny"], "not allowed"),
    (["bench", "--model", "/no/such/dir"], "no such file"),
    (["bench", "--model", "preset:nope"], "unknown preset"),
    (["bench", "--preset", "tiny", "--device", "gpu"], "cuda:N"),
    (["bench", "--preset", "tiny", "--cache", "dense"], "invalid choice"),
    (["bench", "--preset", "tiny", "--graphs", "maybe"], "invalid choice"),
    (["bench", "--preset", "tiny", "--json", "/no/such/dir/x.json"], "does not exist"),
    (["generate", "--model", "preset:tiny"], "give the prompt once"),
    (["generate", "--model", "preset:tiny", "--ids", "1,a"], "'a'"),
    (["generate", "--model", "preset:tiny", "--ids", "1", "--top-p", "0"], "(0, 1]"),
    (["generate", "--model", "preset:tiny", "--ids", "1", "--temperature", "-1"], ">= 0"),
    (["generate", "--model", "preset:tiny", "--ids", "1", "--max-new-tokens", "0"], ">= 1"),
    (["ppl", "--model", "preset:tiny", "--text", "/no/such/file.txt"], "no such file"),
    (["embed", "--model", "preset:tiny"], "--text --ids"),
    (["transcribe", "/no/such.wav", "--model", "preset:tiny"], "no such file"),
    (["info", "/no/such/dir"], "no such file"),
    (["info"], "required"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in _one_line_error(capsys)


def test_no_arguments_print_the_help(capsys):
    """`metrale` alone prints `metrale --help` (it was an error naming COMMAND); -V is
    --version."""
    assert main([]) == 0
    alone = capsys.readouterr()
    assert main(["--help"]) == 0
    assert alone.out == capsys.readouterr().out and alone.err == ""
    assert main(["-V"]) == 0 and capsys.readouterr().out.startswith("metrale ")


def test_help_for_every_command(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for cmd in ("bench", "generate", "ppl", "embed", "transcribe", "info", "check-kernels"):
        assert cmd in top
        assert main([cmd, "--help"]) == 0
        assert "usage: metrale " + cmd in capsys.readouterr().out


def test_metrale_error_exits_1_with_one_line(capsys):
    # a prompt needs a tokenizer.json, which a preset does not have
    assert main(["generate", "--model", "preset:tiny", "--prompt", "hi"]) == 1
    assert "--ids" in _one_line_error(capsys)
    # a token id outside the vocabulary
    assert main(["generate", "--model", "preset:tiny", "--ids", "999999",
                 "--device", "cpu"]) == 1
    assert "vocab" in _one_line_error(capsys)
    # bench of a non-decoder architecture
    assert main(["bench", "--preset", "whisper-small", "--device", "cpu"]) == 1
    assert "decoder-only" in _one_line_error(capsys)
    # prompt + generation longer than the model's context
    assert main(["bench", "--preset", "tiny", "--device", "cpu", "--prompt-len", "4000"]) == 1
    assert "max_position_embeddings" in _one_line_error(capsys)


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    assert main(["bench", "--preset", "tiny", "--device", "cpu",
                 "--plot", str(tmp_path / "p.png")]) == 1
    assert "metrale[plot]" in _one_line_error(capsys)


def test_transcribe_before_its_engine_exists_or_after(capsys, tmp_path):
    wav = tmp_path / "a.wav"
    wav.write_bytes(b"RIFF")
    rc = main(["transcribe", str(wav), "--model", "preset:tiny", "--device", "cpu"])
    assert rc == 1  # not available yet, or a bad wav / not a whisper model: one line
    _one_line_error(capsys)


def test_info(capsys):
    assert main(["info", "preset:llama-3.1-8b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "llama"
    assert d["parameters"] == 8_030_261_248
    assert d["weight_bytes"] == 2 * d["parameters"]
    assert d["memory_needed_bytes"] > d["weight_bytes"] + 4096 * d["kv_bytes_per_token"]
    assert main(["info", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "architecture   llama" in out and "memory needed" in out


def test_generate_ppl_embed_with_ids(capsys):
    assert main(["generate", "--model", "preset:tiny", "--device", "cpu", "--ids", "1,2,3",
                 "--max-new-tokens", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert len(out.out.split()) == 3 and "3 tokens (length)" in out.err
    assert main(["generate", "--model", "preset:tiny", "--device", "cpu", "--ids", "1,2,3",
                 "--max-new-tokens", "3", "--ignore-eos", "--temperature", "0.8",
                 "--top-k", "5", "--top-p", "0.9", "--seed", "7"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert main(["ppl", "--model", str(FIXTURE), "--device", "cpu", "--ids", "1,2,3,4,5",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == 5 and d["perplexity"] > 1
    assert main(["embed", "--model", "preset:tiny", "--device", "cpu", "--ids", "1,2",
                 "--ids", "3", "--json"]) == 0
    vecs = json.loads(capsys.readouterr().out)
    assert len(vecs) == 2 and abs(vecs[0]["norm"] - 1) < 1e-4
    assert len(vecs[0]["vector"]) == 128


def test_bench_subprocess_writes_the_json_schema(tmp_path):
    from metrale.bench import RESULT_KEYS, TOP_KEYS
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "metrale.cli", "bench", "--preset", "tiny",
                        "--device", "cpu", "--batch", "1,2", "--prompt-len", "16",
                        "--gen-len", "4", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "decode tok/s" in p.stdout
    d = json.loads(out.read_text())
    for k in TOP_KEYS:
        assert k in d
    assert d["device"] == "cpu" and d["gpu_name"] is None
    assert [r["batch"] for r in d["results"]] == [1, 2]
    for r in d["results"]:
        assert set(RESULT_KEYS) <= set(r)
        assert r["preset"] == "tiny" and r["prompt_len"] == 16 and r["gen_len"] == 4
        for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "itl_ms_p50",
                  "itl_ms_p99"):
            assert isinstance(r[k], float) and r[k] > 0
        assert r["itl_ms_p99"] >= r["itl_ms_p50"]
        assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0
        assert r["hbm_gb_s"] is None and r["roofline_fraction"] is None
    assert d["command"].startswith("metrale bench --preset tiny")


def test_python_dash_m_metrale_is_the_command_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "metrale", "info", "preset:tiny"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "preset:tiny" in p.stdout and "4 layers, hidden 128" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "metrale", "no-such-command"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert bad.returncode != 0 and "no-such-command" in bad.stderr
