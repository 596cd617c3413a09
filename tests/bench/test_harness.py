"""The benchmark harness (`metrale.bench`) and `benchmarks/bench_kernels.py` on the CPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from metrale.bench import (RESULT_KEYS, TOP_KEYS, BenchConfig, check_schema, format_table,
                           run_bench, write_json)
from metrale.bench import roofline
from metrale.errors import InvalidArgument
from metrale.formats import MemorySource, num_parameters
from metrale.gpu_runtime import HostBackend

ROOT = Path(__file__).resolve().parents[2]


def test_paged_report_schema_and_table(tmp_path):
    be = HostBackend()
    r = run_bench(BenchConfig(model="preset:tiny", batches=(1, 3), prompt_len=20, gen_len=3,
                              progress=False), backend=be)
    check_schema(r)
    assert [x["batch"] for x in r["results"]] == [1, 3]
    for x in r["results"]:
        assert set(RESULT_KEYS) <= set(x)
        assert x["decode_steps"] == 3 and x["prefill_seqs_timed"] == x["batch"]
        assert x["peak_memory_bytes"] >= r["parameters"] * 2  # weights are live
        assert x["hbm_gb_s"] is None and x["roofline_fraction"] is None
    assert r["device"] == "cpu" and r["copy_bandwidth_gb_s"] is None
    cpu = r["cpu"]      # what a CPU figure means: the model and its vector units
    assert cpu["cpus"] >= 1 and isinstance(cpu["flags"], list)
    assert cpu["model"] is None or isinstance(cpu["model"], str)
    if Path("/proc/cpuinfo").exists():
        assert cpu["model"] and ("avx2" in cpu["flags"]) == \
            ("avx2" in Path("/proc/cpuinfo").read_text().split())
    want_gemm = "numpy" if be.native is None else f"native {be.native.kind}"
    assert cpu["gemm"] == want_gemm   # which GEMM twin implementation ran
    assert be.live_bytes() == 0  # torn down
    p = write_json(r, tmp_path / "r.json")
    assert set(TOP_KEYS) <= set(json.loads(p.read_text()))
    table = format_table(r)
    assert "decode tok/s" in table and "\n    3 " in table
    assert f"GEMM {want_gemm}" in table.splitlines()[0]


def _count_prefill_calls(monkeypatch):
    from metrale.model_engine import TransformerModel
    calls = []
    real_one, real_batch = TransformerModel.prefill, TransformerModel.prefill_batch_chunk

    def one(self, tokens, seq, stream):
        calls.append(("prefill", 1, len(tokens)))
        return real_one(self, tokens, seq, stream)

    def batch(self, slices, stream):
        calls.append(("batch", len(slices), sum(s.chunk_len for s in slices)))
        return real_batch(self, slices, stream)

    monkeypatch.setattr(TransformerModel, "prefill", one)
    monkeypatch.setattr(TransformerModel, "prefill_batch_chunk", batch)
    return calls


@pytest.mark.parametrize("mode", ["batched", "each"])
def test_prefill_mode_batched_shares_passes_each_does_not(monkeypatch, mode):
    calls = _count_prefill_calls(monkeypatch)
    r = run_bench(BenchConfig(model="preset:tiny", batches=(3,), prompt_len=20, gen_len=2,
                              warmup=0, reps=1, prefill=mode, progress=False),
                  backend=HostBackend())
    # first the untimed finiteness check (one prompt of min(prompt_len, 32) tokens); then,
    # batched: max_prefill_tokens = 3 * 20, so one call holds the three prompts
    assert calls[0] == ("prefill", 1, 20)
    assert calls[1:] == ([("batch", 3, 60)] if mode == "batched" else [("prefill", 1, 20)] * 3)
    x = r["results"][0]
    assert x["prefill_seqs_timed"] == 3 and x["prefill_tokens_per_s"] > 0
    assert r["settings"]["prefill"] == mode and f"prefill {mode}" in format_table(r)


def test_batched_prefill_groups_fit_one_pass_and_the_budget_copies_whole_groups(monkeypatch):
    calls = _count_prefill_calls(monkeypatch)
    r = run_bench(BenchConfig(model="preset:tiny", batches=(5,), prompt_len=1000, gen_len=3,
                              warmup=0, reps=1, max_seconds=0.01, progress=False),
                  backend=HostBackend())
    # 5 * 1000 tokens > 4096: groups of 4 prompts; the budget is gone after the first
    # group, so the fifth sequence is a copy
    assert calls == [("prefill", 1, 32), ("batch", 4, 4000)]   # the finiteness check first
    assert r["results"][0]["prefill_seqs_timed"] == 4


def test_contiguous_cache_under_a_time_budget_copies_prompts():
    be = HostBackend()
    r = run_bench(BenchConfig(model="preset:tiny", batches=(3,), prompt_len=20, gen_len=6,
                              cache="contiguous", max_seconds=0.01, warmup=0,
                              progress=False), backend=be)
    x = r["results"][0]
    assert x["prefill_seqs_timed"] == 1          # the rest were copied, not prefilled
    assert x["decode_steps"] == 2                # the minimum under an exhausted budget
    assert x["cache"] == "contiguous" and x["decode_tokens_per_s"] > 0
    assert "time budget" in format_table(r)
    assert be.live_bytes() == 0


def test_paged_budget_forks_and_matches_fresh_decode():
    # A forked row decodes exactly like a freshly prefilled one (same prompt, same tokens).
    import metrale
    from metrale.bench.rows import Rows
    m = metrale.load("preset:tiny", HostBackend(), max_batch=4, progress=False)
    s = m.default_stream()
    rows = Rows(m, "paged", 2, 64)
    fresh = Rows(m, "paged", 1, 64)
    try:
        prompt = list(range(1, 21))
        t0 = m.argmax_on_device(m.prefill(prompt, rows.seqs[0], s), s)
        rows.replicate(0, 1, s)
        m.prefill(prompt, fresh.seqs[0], s)
        a = m.argmax_batch(m.decode_batch([t0, t0], rows.seqs, s), 2, s)
        b = m.argmax_batch(m.decode_batch([t0], fresh.seqs, s), 1, s)
        assert a[0] == a[1] == b[0]
    finally:
        rows.close()
        fresh.close()
        m.teardown()


def test_bad_config_is_invalid_argument():
    for kw in ({"batches": ()}, {"batches": (0,)}, {"prompt_len": 0}, {"gen_len": True},
               {"cache": "dense"}, {"reps": 0}, {"max_seconds": 0}, {"prefill": "all"}):
        with pytest.raises(InvalidArgument):
            BenchConfig(**kw).check()


def test_decode_step_bytes():
    meta = MemorySource.preset("llama-3.1-8b").metadata()
    kv_tok = 32 * 2 * 8 * 128 * 2
    assert roofline.kv_bytes_per_token(meta) == kv_tok
    w = 2 * num_parameters(meta)
    table = meta.vocab_size * meta.hidden_size * 2
    # untied: the embedding table is read only for the gathered rows
    assert roofline.decode_step_bytes(meta, [513, 100]) == \
        w - table + 2 * meta.hidden_size * 2 + 613 * kv_tok
    tiny = MemorySource.preset("tiny").metadata()
    assert roofline.weight_read_bytes(tiny, 1) < 2 * num_parameters(tiny)


def test_percentile_and_median():
    assert roofline.percentile([], 50) is None
    assert roofline.percentile([3.0], 99) == 3.0
    assert roofline.percentile([1, 2, 3, 4], 50) == 2.5
    assert roofline.percentile(range(101), 99) == pytest.approx(99.0)
    assert roofline.median([None, 1.0, 3.0]) == 2.0
    assert roofline.copy_bandwidth(HostBackend()) is None
    assert roofline.gemm_peak_tflops(HostBackend()) is None


def test_check_schema_names_what_is_missing():
    with pytest.raises(InvalidArgument, match="results"):
        check_schema({k: None for k in TOP_KEYS if k != "results"})
    with pytest.raises(InvalidArgument, match="ttft_ms"):
        check_schema({**{k: None for k in TOP_KEYS},
                      "results": [{k: 1 for k in RESULT_KEYS if k != "ttft_ms"}]})


def test_bench_kernels_small_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels",
                                                  ROOT / "benchmarks" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "k.json"
    rc = mod.main(["--device", "cpu", "--small", "--json", str(out), "--reps", "1"])
    d = json.loads(out.read_text())
    assert rc == 0, [r for r in d["results"] if "error" in r]
    assert d["errors"] == 0 and d["shapes"] == "small"
    # every kernel module of metrale/ops has a benchmark
    assert d["families_without_benchmark"] == []
    for fam in ("embedding", "rmsnorm", "activation", "cast", "elementwise", "gemv", "gemm",
                "gemm_tc", "rope", "kv_cache", "attention", "argmax", "sampling"):
        assert fam in d["families"]
    for r in d["results"]:
        assert r["time_us"] > 0 and r["fraction_of_peak"] is None  # no peaks on the CPU
        assert r["gb_s"] is not None or r["tflop_s"] is not None


def test_a_checkpoint_is_recorded_as_a_model_path_and_a_preset_as_a_preset(
        tmp_path, monkeypatch):
    """A .gguf used to land in every row's "preset" ("llama.gguf"); now "preset" is a
    preset's NAME only, and a checkpoint is its path (relative to the current directory
    when it is under it, else its name) in "model", at the top and in each row."""
    gguf = ROOT / "tests" / "fixtures" / "gguf" / "llama.gguf"
    small = dict(batches=(1,), prompt_len=8, gen_len=2, progress=False)
    monkeypatch.chdir(ROOT)
    r = run_bench(BenchConfig(model=str(gguf), **small), backend=HostBackend())
    check_schema(r)
    assert r["model"] == "tests/fixtures/gguf/llama.gguf"
    assert [(x["preset"], x["model"]) for x in r["results"]] == [(None, r["model"])]
    # not under the current directory: its name alone (bench.env.recorded_path: a report
    # records no directory of the machine it ran on)
    monkeypatch.chdir(tmp_path)
    r = run_bench(BenchConfig(model=str(gguf.parent / ".." / "gguf" / "llama.gguf"),
                              **small), backend=HostBackend())
    assert r["model"] == "llama.gguf" and r["results"][0]["preset"] is None
    r = run_bench(BenchConfig(model="preset:tiny", **small), backend=HostBackend())
    assert r["model"] == "preset:tiny"
    assert [(x["preset"], x["model"]) for x in r["results"]] == [("tiny", "preset:tiny")]
