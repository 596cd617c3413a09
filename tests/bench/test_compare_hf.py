"""`metrale bench --compare-hf`: the refusal without torch, interleaving, ratios and the report
(with a fake HF side: CI has no torch), and the real thing on `tiny` when torch is there."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from metrale.bench import BenchConfig, check_schema, format_table, run_bench
from metrale.bench.compare import HFComparison, parse_dtypes
from metrale.bench.compare_hf import metrale_last_logits, require_torch
from metrale.cli import main
from metrale.errors import InvalidArgument, Unsupported
from metrale.gpu_runtime import HostBackend
from metrale.model_engine import TransformerModel

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


@pytest.fixture
def no_torch(monkeypatch):
    """torch and transformers unimportable, even where they are installed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_require_torch_names_what_to_install(no_torch):
    with pytest.raises(Unsupported, match=r"pip install torch transformers"):
        require_torch()


def test_cli_without_torch_fails_before_loading(no_torch, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the torch check")
    monkeypatch.setattr(TransformerModel, "__init__", no_load)
    assert main(["bench", "preset:tiny", "--device", "cpu", "--compare-hf"]) == 1
    err = capsys.readouterr().err
    assert "--compare-hf needs torch and transformers" in err
    assert "pip install torch transformers" in err


def test_hf_dtypes_argument(capsys):
    assert parse_dtypes("bfloat16") == ("bfloat16",)
    assert parse_dtypes("float32, bfloat16") == ("float32", "bfloat16")
    for bad in ("", "float16", "float32,float32"):
        with pytest.raises(InvalidArgument):
            parse_dtypes(bad)
    assert main(["bench", "preset:tiny", "--hf-dtypes", "float32"]) == 2
    assert "option of --compare-hf" in capsys.readouterr().err
    assert main(["bench", "preset:tiny", "--compare-hf", "--hf-dtypes", "int8"]) == 2


class FakeRunner:
    """An HF runner with fixed timings; its logits are metrale's own, scaled."""

    PREFILL_S, DECODE_S = 0.5, 0.25

    def __init__(self, name, events, reference, scale):
        self.name, self.events, self.reference, self.scale = name, events, reference, scale

    def rep(self, prompts, steps):
        self.events.append((self.name, [list(p) for p in prompts], steps))
        return {"prefill_s": self.PREFILL_S, "decode_s": self.DECODE_S, "decode_steps": steps}

    def last_logits(self, prompt):
        return metrale_last_logits(self.reference, prompt) * self.scale


def fake_load(events, scale=1.0):
    def load(source, device, dtypes):
        assert device == "cpu"
        ref = TransformerModel(HostBackend(), source, kv_blocks=16, max_batch=1,
                               max_prefill_tokens=64, max_seq_len=128)
        facts = {"torch": "fake", "transformers": "fake", "torch_threads": 1,
                 "device": device, "load_s": {}, "params_not_from_source": {}}
        return {d: FakeRunner(d, events, ref, scale) for d in dtypes}, facts
    return load


@pytest.fixture
def record_prefills(monkeypatch):
    """Every metrale prefill's tokens, in order, into the returned event list."""
    events = []
    real, real_batch = TransformerModel.prefill, TransformerModel.prefill_batch_chunk

    def prefill(self, tokens, seq, stream):
        events.append(("metrale", list(tokens), None))
        return real(self, tokens, seq, stream)

    def prefill_batch_chunk(self, slices, stream):   # the bench's default, batched prefill
        events.extend(("metrale", list(s.prompt_tokens), None) for s in slices)
        return real_batch(self, slices, stream)
    monkeypatch.setattr(TransformerModel, "prefill", prefill)
    monkeypatch.setattr(TransformerModel, "prefill_batch_chunk", prefill_batch_chunk)
    return events


def test_interleaved_same_prompts_ratios_and_report(record_prefills, tmp_path):
    events = record_prefills
    be = HostBackend()
    peer = HFComparison(load=fake_load(events))
    P, G = 12, 3
    r = run_bench(BenchConfig(model="preset:tiny", batches=(1, 2), prompt_len=P, gen_len=G,
                              progress=False), backend=be, peer=peer)
    assert be.live_bytes() == 0
    check_schema(r)
    assert r["settings"]["reps"] == 2 and r["settings"]["max_seconds"] is None
    assert r["peak_rss_bytes"] > 0
    hf = r["hf"]
    assert hf["dtypes"] == ["float32", "bfloat16"]
    assert "prefill_batch_chunk" in hf["metrale_prefill_mode"]   # batched, as HF's forward
    for check in hf["logits_check"].values():
        assert check["rel_max_err"] == 0.0 and check["argmax_agree"]
    # After each timed metrale repetition of B prefills: one rep per dtype on those prompts
    # (G decode steps; the untimed HF warm-ups do 2), with no metrale prefill in between.
    for B in (1, 2):
        timed = [i for i, e in enumerate(events)
                 if e[0] != "metrale" and len(e[1]) == B and e[2] == G]
        assert [events[i][0] for i in timed] == ["float32", "bfloat16"] * 2
        for i in timed[::2]:
            ours = [e[1] for e in events[:i] if e[0] == "metrale"][-B:]
            assert all(len(p) == P for p in ours)
            assert events[i][1] == ours == events[i + 1][1]
        assert timed[1] + 1 < timed[2] and all(
            e[0] == "metrale" for e in events[timed[1] + 1:timed[2]])
    # ratios: metrale's medians over the fake's fixed rates
    for row, res in zip(hf["results"], r["results"]):
        B = row["batch"]
        for name in ("float32", "bfloat16"):
            assert row[name]["prefill_tokens_per_s"] == pytest.approx(B * P / 0.5)
            assert row[name]["decode_tokens_per_s"] == pytest.approx(B * G / 0.25)
            assert row["ratios"][f"prefill_vs_{name}"] == pytest.approx(
                res["prefill_tokens_per_s"] / (B * P / 0.5))
            assert row["ratios"][f"decode_vs_{name}"] == pytest.approx(
                res["decode_tokens_per_s"] / (B * G / 0.25))
    table = format_table(r)
    assert "metrale/HF decode" in table and "peak RSS" in table
    ratio = f"{hf['results'][1]['ratios']['decode_vs_bfloat16']:.2f}"
    assert any(line.split()[:2] == ["2", "bfloat16"] and line.split()[-1] == ratio
               for line in table.splitlines())
    json.dumps(r)  # JSON-ready


def test_logits_mismatch_refuses_and_tears_down():
    be = HostBackend()
    peer = HFComparison(dtypes=("bfloat16",), load=fake_load([], scale=1.2))
    with pytest.raises(Unsupported, match=r"bfloat16 last-row logits differ"):
        run_bench(BenchConfig(model="preset:tiny", batches=(1,), prompt_len=8, gen_len=2,
                              progress=False), backend=be, peer=peer)
    assert be.live_bytes() == 0


@pytest.mark.skipif(not HAVE_TORCH, reason="torch and transformers are not installed")
def test_real_transformers_on_tiny():
    be = HostBackend()
    r = run_bench(BenchConfig(model="preset:tiny", batches=(1, 2), prompt_len=16, gen_len=3,
                              progress=False), backend=be, peer=HFComparison())
    hf = r["hf"]
    assert hf["params_not_from_source"] == {"float32": [], "bfloat16": []}
    for check in hf["logits_check"].values():
        assert check["rel_max_err"] < 0.05
    for row in hf["results"]:
        assert all(v > 0 for v in row["ratios"].values())
