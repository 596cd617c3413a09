"""Progress for long work when stderr is not a terminal (issue 44): loading weights, `ppl`
and a single 30 s `transcribe` window say how far they got, once they have taken a while
(`metrale.progress.Ticker`); quick runs stay silent."""
from __future__ import annotations

import re

import pytest

import metrale
import metrale.progress as progress
from metrale.cli import main
from metrale.progress import Ticker
from tests.test_cli_end_to_end import stereo_float_wav
from tests.test_cli_paths import FIXTURES, checkpoint


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_ticker_is_silent_at_first_then_every_few_seconds(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    t = Ticker("work", after_s=2.0, every_s=5.0)
    for dt, text in ((1.0, "a"), (1.5, "b"), (1.0, "c"), (3.0, "d"), (2.5, "e"), (0.5, "f")):
        clock.now += dt
        t.tick(text)
    t.done("all")
    assert capsys.readouterr().err.splitlines() == [
        "metrale: work: b (2.5 s)", "metrale: work: e (9.0 s)", "metrale: work: all (9.5 s)"]
    quick = Ticker("quick")
    quick.tick("x")
    quick.done("finished")        # nothing was said, so nothing is said at the end
    assert capsys.readouterr().err == ""


@pytest.fixture
def eager(monkeypatch):
    """Tickers that speak at once and at every tick (the runs below take milliseconds)."""
    monkeypatch.setattr(Ticker.__init__, "__defaults__", (0.0, 0.0))


def test_loading_says_how_far_it_got(eager, capsys):
    metrale.load(FIXTURES / "llama_gqa", "cpu", progress=True).teardown()
    err = capsys.readouterr().err.splitlines()   # (captured: not a terminal)
    load = [ln for ln in err if ln.startswith("metrale: loading ")]
    assert len(load) >= 3 and re.fullmatch(r"metrale: loading \S+llama_gqa: \d+% of 0\.00 GiB "
                                           r"\(\d+\.\d s\)", load[0]), err
    assert re.fullmatch(r"metrale: loading \S+: 0\.00 GiB loaded \(\d+\.\d s\)", load[-1])
    metrale.load(FIXTURES / "llama_gqa", "cpu", progress=False).teardown()
    assert "loading" not in capsys.readouterr().err


def test_ppl_says_how_many_tokens_it_scored(eager, capsys):
    ids = ",".join(str(5 + i % 50) for i in range(40))
    assert main(["ppl", "preset:tiny", "--ids", ids, "--window", "16", "--device", "cpu"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("metrale: ppl:")]
    assert [re.sub(r" \(\d+\.\d s\)$", "", ln) for ln in lines][-1] == \
        "metrale: ppl: 39 tokens scored"
    assert any(re.match(r"metrale: ppl: \d+ of 39 tokens scored", ln) for ln in lines), lines


def test_one_transcribe_window_says_how_far_it_got(eager, tmp_path, capsys):
    d = checkpoint(tmp_path, "whisper_tiny")
    wav = tmp_path / "a.wav"
    stereo_float_wav(wav, seconds=2.0)
    assert main(["transcribe", str(d), str(wav), "--language", "en", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    lines = [re.sub(r" \(\d+\.\d s\)$", "", ln) for ln in capsys.readouterr().err.splitlines()
             if ln.startswith("metrale: transcribe:")]
    assert lines[0] == f"metrale: transcribe: {wav}: 0.0-2.0 s: audio encoded", lines
    assert all(re.fullmatch(rf"metrale: transcribe: {re.escape(str(wav))}: 0\.0-2\.0 s: "
                            r"\d tokens decoded", ln) for ln in lines[1:]), lines
