"""check-kernels --profile's pipeline on the tiny preset: a model step recorded on the
TraceBackend (no memory, no kernels), replayed on the EmuBackend's counters with sampled
blocks, and turned into an estimate that says it is one."""
from __future__ import annotations

import math
import re

import pytest

from metrale.formats.source import MemorySource
from metrale.bench import emu_profile as profile
from metrale.gpu_runtime.emu import estimate
from metrale.gpu_runtime.emu.trace import ProfileEmuBackend, TraceBackend, ZeroSource, replay
from tests.conftest import emu_available

pytestmark = pytest.mark.skipif(not emu_available(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def recorded():
    return profile.record("tiny", batch=2, context=40, prefill_len=24)


def test_a_trace_records_launches_and_small_copies_only(recorded):
    trace, meta = recorded
    names = [s.name for s in trace.segments]
    assert names == ["prefill", "decode"] and all(s.end > s.start for s in trace.segments)
    dec = trace.segments[1]
    kernels = {f"{o.args[0]}.{o.args[1]}" for o in trace.ops[dec.start:dec.end]
               if o.kind == "launch"}
    assert {"gemm_tc.gemm_tc_bf16_16x16", "rmsnorm.rmsnorm", "rope.rope_write_kv"} <= kernels
    assert any(k.startswith("attention.decode_attention") for k in kernels)
    copies = [o for o in trace.ops[dec.start:dec.end] if o.kind == "h2d"]
    assert copies and all(o.data is not None for o in copies)   # step metadata kept


def test_zero_source_weights_are_never_touched():
    src = ZeroSource(MemorySource.preset("llama-3.1-8b"))
    tb = TraceBackend()
    w = src.read_bf16("lm_head.weight")
    assert w.shape == (128256, 4096) and not w.any()
    p = tb.alloc(w.nbytes)
    tb.copy_h2d(w, p)
    assert tb.trace.ops[-1].data is None and tb.live_bytes() == w.nbytes


def test_replay_counts_every_launch_and_repeats_layers(recorded):
    trace, meta = recorded
    recs = replay(trace, "decode", ProfileEmuBackend(sample_blocks=3, full_grid=4))
    dec = trace.segments[1]
    n_launch = sum(o.kind == "launch" for o in trace.ops[dec.start:dec.end])
    assert len(recs) == n_launch
    assert any(r.get("repeat") for r in recs)          # the layers repeat
    for r in recs:
        grid = math.prod(r["grid"])
        assert r["counters"]["blocks"] == (grid if grid <= 4 else 3)


def test_estimates_are_labelled_and_bounded(recorded):
    trace, meta = recorded
    be = ProfileEmuBackend(sample_blocks=4, full_grid=64)
    recs = replay(trace, "decode", be)
    step = profile.profile_step(recs, meta, "decode", 2, [41, 41], figures={})
    for dev, d in step["devices"].items():
        assert "estimate" in dev
        assert d["estimated_us"] >= len(recs) * estimate.FIXED_US
        assert 0 < d["roofline_fraction"] <= 1
    gemm = next(k for k in step["kernels"] if k["kernel"] == "gemm_tc.gemm_tc_bf16_16x16")
    assert gemm["counters_scaled_to_grid"]["mma"] > 0
    assert gemm["gld_sector_efficiency"] >= 0.9 and gemm["ldmatrix_bank_conflicts"] == 0
    rep = profile.report([{"preset": "tiny", "batch": 2, "context": 40, "prefill_len": 24,
                           "steps": {"decode": step}}])
    assert rep["estimate"] is True and "not measured" in rep["what"]
    assert profile.format_report(rep).startswith("ESTIMATE")


def test_occupancy_from_registers_and_shared_memory():
    occ = estimate.occupancy(estimate.H100, 256, 128, 0)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (2, "registers")
    occ = estimate.occupancy(estimate.H100, 64, 72, 48 * 1024)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (4, "shared memory")


def test_estimate_and_measurement_side_by_side():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "estimate_vs_measured.py"
    spec = importlib.util.spec_from_file_location("estimate_vs_measured", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h100, h200 = estimate.H100.name, estimate.H200.name
    est = {"presets": [{"preset": "llama-3.1-8b", "context": 1024, "steps": {"decode": {
        "devices": {h100: {"estimated_us": 5000.0}, h200: {"estimated_us": 4000.0}},
        "kernels": [{"kernel": "gemm_tc.gemm_tc_bf16_16x16", "variants": [
            {"scalars": [1, 4096, 14336], "launches": 32, h100: 50.0, h200: 40.0}]},
            {"kernel": "rmsnorm.rmsnorm", "variants": []}]}}}]}
    bench = {"gpu_name": "NVIDIA H200", "results": [{"preset": "llama-3.1-8b", "batch": 1,
                                                    "itl_ms_p50": 4.5}]}
    kernels = {"results": [{"family": "gemm_tc", "kernel": "gemm_tc_bf16 down_proj",
                            "shape": {"m": 1, "n": 4096, "k": 14336}, "time_us": 44.0}]}
    rows = mod.rows(est, bench, kernels)
    assert [(r["device"], r["estimated_us"], r["measured_us"]) for r in rows] == [
        (h200, 4000.0, 4500.0), (h200, 40.0, 44.0)]


def test_prefill_roofline_counts_active_parameters():
    # FLOPs from parameters, not bytes: a 4-bit model does the BF16 model's math (both bound
    # by FLOPs at 512 tokens), and a MoE token runs its top_k experts only, so qwen3-30b-a3b
    # (~3.3B active of 30.5B) is bound by reading its experts, never by all experts' FLOPs.
    from metrale.bench.roofline import weight_read_bytes
    h200, n = estimate.H200, 512
    meta = {p: MemorySource.preset(p).metadata()
            for p in ("llama-3.1-8b", "llama-3.1-8b-gptq", "qwen3-30b-a3b")}
    dense = profile.prefill_roofline(meta["llama-3.1-8b"], n, h200)
    assert dense > weight_read_bytes(meta["llama-3.1-8b"], n) / h200.hbm_bytes_per_s * 1e6
    assert profile.prefill_roofline(meta["llama-3.1-8b-gptq"], n, h200) == pytest.approx(dense)
    moe = meta["qwen3-30b-a3b"]
    assert profile.prefill_roofline(moe, n, h200) == pytest.approx(
        weight_read_bytes(moe, n) / h200.hbm_bytes_per_s * 1e6)


def test_check_kernels_profile_says_each_phase(monkeypatch, capsys):
    """`check-kernels --profile` runs for minutes: a line per NVRTC compile and per phase of
    each preset goes to stderr, terminal or not (its help promises it; it was silent)."""
    from metrale.cli import main

    def figures(on_progress=None):   # NVRTC's 21 compiles take 30 s: one stands for them
        on_progress("NVRTC sm_90 argmax.cu [1/1]")
        return {}
    monkeypatch.setattr(profile, "nvrtc_figures", figures)
    real = profile.profile_preset
    monkeypatch.setattr(profile, "profile_preset", lambda p, **kw: real(
        p, batch=1, context=24, prefill_len=16, **kw))
    assert main(["check-kernels", "--profile", "--preset", "tiny"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.startswith("metrale check-kernels --profile:")]
    assert [re.sub(r" \(\d+\.\d s\)$", "", ln) for ln in err] == [
        "metrale check-kernels --profile: NVRTC sm_90 argmax.cu [1/1]",
        "metrale check-kernels --profile: tiny: recorded a prefill of 16 and a decode step "
        "of batch 1",
        "metrale check-kernels --profile: tiny: decode step counted on the emulator "
        f"({err[2].split('(')[1].split()[0]} launches)",
        "metrale check-kernels --profile: tiny: prefill step counted on the emulator "
        f"({err[3].split('(')[1].split()[0]} launches)"], err
