"""The command line as a newcomer meets it (issue 14): MODEL first (with --model kept),
streamed text that never breaks a character, --chat and generation_config defaults, the
context limit, a Whisper checkpoint pointed at text commands, Hub ids, bench on a model with
few positions, and a closed pipe."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metrale.cli import CLOSED_PIPE_STATUS, main
from metrale.cli.bench import fit_lengths

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer"


def checkpoint(tmp_path, name="llama_gqa", tokenizer=True, config=None, gen=None) -> Path:
    """A copy of a fixture checkpoint with the fixture tokenizer (and edited json files)."""
    d = tmp_path / name
    d.mkdir()
    for f in (FIXTURES / name).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, d / f.name)
        elif f.suffix == ".safetensors":
            os.symlink(f, d / f.name)
    if tokenizer:
        for f in TOKENIZER.iterdir():
            shutil.copy(f, d / f.name)
    for fname, changes in (("config.json", config), ("generation_config.json", gen)):
        if changes:
            c = json.loads((d / fname).read_text())
            c.update(changes)
            (d / fname).write_text(json.dumps(c))
    return d


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("metrale: error:"), err
    return err[0]


def test_model_first_with_model_alias(capsys):
    for argv in (["embed", "preset:tiny", "--ids", "1,2", "--json", "--device", "cpu"],
                 ["embed", "--model", "preset:tiny", "--ids", "1,2", "--json",
                  "--device", "cpu"]):
        assert main(argv) == 0
        assert len(json.loads(capsys.readouterr().out)) == 1
    assert main(["embed", "preset:tiny", "--model", "preset:tiny", "--ids", "1"]) == 2
    assert "not both" in one_error_line(capsys)
    assert main(["ppl", "--ids", "1,2"]) == 2
    assert "metrale ppl MODEL" in one_error_line(capsys)


def test_a_hub_id_says_how_to_download(capsys):
    assert main(["generate", "meta-llama/Llama-3.2-1B", "--prompt", "hi"]) == 2
    line = one_error_line(capsys)
    assert "local checkpoint directories only" in line
    assert "hf download meta-llama/Llama-3.2-1B --local-dir Llama-3.2-1B" in line
    assert main(["info", "./no/such/dir"]) == 2
    assert "hf download" not in one_error_line(capsys)


def test_load_of_a_hub_id_gives_the_same_hint(tmp_path, monkeypatch):
    import metrale
    monkeypatch.chdir(tmp_path)
    with pytest.raises(metrale.FormatError, match="hf download Qwen/Qwen2.5-0.5B-Instruct "
                       "--local-dir Qwen2.5-0.5B-Instruct"):
        metrale.load("Qwen/Qwen2.5-0.5B-Instruct", device="cpu")
    with pytest.raises(metrale.FormatError, match="no such file") as e:
        metrale.load("./no/such/dir", device="cpu")
    assert "hf download" not in str(e.value)


def test_streamed_text_is_the_decoded_text(tmp_path, capsys):
    import metrale
    from metrale.engine import generate
    from tokenizers import Tokenizer
    d = checkpoint(tmp_path)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    prompt = "Hello é 中文 🙂"
    assert main(["generate", str(d), "--prompt", prompt, "--max-new-tokens", "60",
                 "--ignore-eos", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    want = generate(metrale.load(d, "cpu", progress=False), tok.encode(prompt).ids, 60,
                    stop_token_ids=[]).tokens
    text = tok.decode(want)
    # some generated tokens are pieces of a UTF-8 character: the case that used to break
    assert any("\ufffd" in tok.decode([t]) for t in want)
    assert out.out == text + "\n"
    assert "60 tokens (length)" in out.err and "greedy" in out.err


def test_chat_and_generation_config_defaults(tmp_path, capsys):
    d = checkpoint(tmp_path, gen={"do_sample": True, "temperature": 0.7, "top_k": 20,
                                  "max_new_tokens": 5})
    assert main(["generate", str(d), "--chat", "--system", "Be brief.", "--prompt", "Hi é",
                 "--ignore-eos", "--seed", "1", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "5 tokens (length)" in err and "temperature 0.7, top_k 20" in err
    # the chat prompt: rendered by the template, one BOS (18 tokens for this conversation)
    from metrale.engine import apply_chat_template
    n = len(apply_chat_template(d, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi é"}]))
    assert f"{n} prompt tokens" in err
    assert main(["generate", str(d), "--prompt", "Hi", "--temperature", "0",
                 "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "greedy" in capsys.readouterr().err
    assert main(["generate", str(FIXTURES / "llama_gqa"), "--ids", "1", "--chat"]) == 1
    assert "--chat" in one_error_line(capsys)


def test_generation_stops_at_the_context_limit(tmp_path, capsys):
    assert main(["generate", "preset:tiny", "--ids", "1,2,3", "--max-seq-len", "8",
                 "--max-new-tokens", "50", "--ignore-eos", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    # prompt + output <= max_seq_len (vLLM's max_model_len): 3 + 5 = 8
    assert len(out.out.split()) == 5 and "5 tokens (length: the context limit)" in out.err
    assert main(["generate", "preset:tiny", "--ids", ",".join(["5"] * 9), "--max-seq-len",
                 "8", "--device", "cpu"]) == 1
    line = one_error_line(capsys)
    assert "prompt of 9 tokens" in line and "limit of 8" in line and "--max-seq-len" in line


@pytest.mark.parametrize("cmd", [["generate", "--ids", "1,2"], ["ppl", "--ids", "1,2"],
                                 ["embed", "--ids", "1,2"]])
def test_text_commands_on_a_speech_model(cmd, capsys):
    argv = [cmd[0], str(FIXTURES / "whisper_tiny")] + cmd[1:] + ["--device", "cpu"]
    assert main(argv) == 1
    assert "this is a speech model: use metrale transcribe" in one_error_line(capsys)


def test_ppl_reports_the_tokens_scored(capsys):
    ids = ",".join(str(4 + i % 200) for i in range(30))
    assert main(["ppl", str(FIXTURES / "llama_gqa"), "--ids", ids, "--window", "8",
                 "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == 30 and d["tokens_scored"] == 29 and d["step"] == 7


def test_bench_fits_a_model_with_few_positions(tmp_path, capsys):
    assert fit_lengths(None, None, 4096, "m")[:2] == (512, 128)
    p, g, note = fit_lengths(None, None, 66, "m")
    assert p + g == 64 and p > g and "--prompt-len" in note
    assert fit_lengths(None, 4, 66, "m")[:2] == (60, 4)
    from metrale import InvalidArgument
    with pytest.raises(InvalidArgument, match="lower --prompt-len or --gen-len"):
        fit_lengths(60, 10, 66, "m")
    with pytest.raises(InvalidArgument, match="--gen-len 70 leaves no room"):
        fit_lengths(None, 70, 66, "m")
    d = checkpoint(tmp_path, tokenizer=False, config={"max_position_embeddings": 40})
    assert main(["bench", str(d), "--batch", "1", "--gen-len", "3", "--device", "cpu",
                 "--max-seconds", "20"]) == 0
    out = capsys.readouterr()
    assert "prompt 35 + gen 3" in out.err and "decode tok/s" in out.out


def test_a_closed_pipe_ends_quietly(tmp_path):
    read, write = os.pipe()
    os.close(read)                    # the reader is gone before anything is written
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "metrale.cli", "embed", "preset:tiny", "--ids",
                        "1,2", "--ids", "3", "--json", "--device", "cpu"],
                       stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write)
    assert p.stderr == "" and p.returncode == CLOSED_PIPE_STATUS
