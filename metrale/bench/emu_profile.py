"""`metrale check-kernels --profile`: every kernel of a decode and a prefill step of a real
model preset, counted on the EmuBackend (trace.py: recorded at the real shape, replayed with
sampled blocks) and turned into an ESTIMATE of its time on H100 and H200 (estimate.py).
Nothing is measured on a GPU; every figure in the report says so.

Steps: decode of `batch` rows at `context` cached tokens each, and a prefill of
`prefill_len` tokens. Per step: the launches, the estimated time per device with the
limiter of each kernel, and the fraction of the roofline (the bytes a decode step must read,
bench/roofline.py, or a prefill's weight bytes and GEMM/attention FLOPs, at the published
peak) the estimate reaches. Per kernel: global-load sector efficiency, shared-memory and
ldmatrix bank conflicts, occupancy from NVRTC's registers and shared memory, and the memory
instructions (file:line) whose requests waste sectors or conflict.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict

from ..formats.source import MemorySource
from ..gpu_runtime.emu import estimate as est
from ..gpu_runtime.emu.trace import ProfileEmuBackend, TraceBackend, ZeroSource, replay

_COUNTER_KEYS = ("blocks", "gld_requests", "gld_sectors", "gld_bytes", "gld_unique",
                 "gst_requests", "gst_sectors", "gst_bytes", "gst_unique", "sld_requests",
                 "sld_wavefronts", "sld_ideal", "sst_requests", "sst_wavefronts", "sst_ideal",
                 "ldsm_requests", "ldsm_wavefronts", "ldsm_ideal", "cp_async", "mma",
                 "barriers", "syncwarps", "warp_ops", "atomics", "gld_ideal", "gst_ideal")


def record(preset: str, *, batch: int, context: int, prefill_len: int):
    """(trace, metadata) of a prefill and a decode step of `preset` (weights all zero)."""
    from ..model_engine import TransformerModel
    src = ZeroSource(MemorySource.preset(preset))
    meta = src.metadata()
    tb = TraceBackend()
    max_len = max(context + 1, prefill_len)
    blocks_per_seq = -(-max_len // 16)
    model = TransformerModel(tb, src, kv_blocks=(batch + 1) * blocks_per_seq + 1,
                             max_batch=max(batch, 1), graphs=False, progress=False,
                             max_prefill_tokens=max(prefill_len, context),
                             max_seq_len=max_len)
    s = model.default_stream()
    tokens = [1 + i % (meta.vocab_size - 1) for i in range(max_len)]
    tb.begin_segment("prefill")
    model.prefill(tokens[:prefill_len], model.alloc_sequence(), s)
    tb.end_segment()
    seqs = [model.alloc_sequence() for _ in range(batch)]
    for seq in seqs:
        model.prefill(tokens[:context], seq, s)
    tb.begin_segment("decode")
    model.decode_batch([7] * batch, seqs, s)
    tb.end_segment()
    return tb.trace, meta


def prefill_roofline(meta, n_tokens: int, dev: est.Device) -> float:
    """Microseconds a prefill of n_tokens needs at least: weight bytes at HBM bandwidth, or
    2 FLOP per active parameter per token (a MoE token runs its top_k experts only) plus
    causal attention's QK and PV at the tensor-core peak. Parameters are counted, not
    derived from bytes, so quantized weights keep their FLOPs."""
    from .roofline import weight_read_bytes
    from ..formats.layout import num_parameters
    from ..formats.moe_config import inactive_parameters
    params = (num_parameters(meta) - inactive_parameters(meta, 1)
              - meta.vocab_size * meta.hidden_size)   # no embedding lookup
    attn = meta.num_layers * 4 * meta.num_heads * meta.head_dim * n_tokens * (n_tokens + 1) / 2
    flops = 2 * params * n_tokens + attn
    return max(weight_read_bytes(meta, n_tokens) / dev.hbm_bytes_per_s,
               flops / dev.tensor_bf16_flops) * 1e6


def nvrtc_figures(on_progress=None) -> dict[str, dict]:
    """kernel name -> {registers, shared_bytes} for sm_90 from NVRTC, {} without NVRTC.
    `on_progress(text)` is told of each file compiled."""
    from ..gpu_runtime import kernel_source
    out = {}
    try:
        files = kernel_source.kernel_files()
        for i, path in enumerate(files, 1):
            _, log = kernel_source.compile_cubin(path.stem, "sm_90")
            for k in kernel_source.parse_ptxas(log):
                out[f"{path.stem}.{k['name']}"] = k
            if on_progress is not None:
                on_progress(f"NVRTC sm_90 {path.name} [{i}/{len(files)}]")
    except Exception:  # no cuda-python / NVRTC here: occupancy is left out
        return {}
    return out


def _sum_counters(recs) -> dict:
    tot = {k: 0 for k in _COUNTER_KEYS}
    for r in recs:
        scale = math.prod(r["grid"]) / max(r["counters"]["blocks"], 1)
        for k in _COUNTER_KEYS:
            tot[k] += r["counters"][k] * (1 if k == "blocks" else scale)
    return tot


def _hot_spots(recs) -> list[dict]:
    """Memory instructions of these launches with wasted sectors (global requests under 90%
    efficient) or bank conflicts, by their share of the kernel's requests."""
    per: dict[tuple, dict] = defaultdict(lambda: {"requests": 0, "units": 0, "ideal": 0})
    for r in recs:
        scale = math.prod(r["grid"]) / max(r["counters"]["blocks"], 1)
        for p in r["counters"]["pcs"]:
            d = per[(p["where"], p["kind"])]
            for k in ("requests", "units", "ideal"):
                d[k] += p[k] * scale
    out = []
    for (where, kind), d in per.items():
        if kind.startswith("global"):
            eff = d["ideal"] / d["units"] if d["units"] else 1.0
            if eff < 0.9:
                out.append({"where": where, "kind": kind, "requests": d["requests"],
                            "sector_efficiency": eff,
                            "sectors_per_request": d["units"] / max(d["requests"], 1)})
        elif d["units"] > d["ideal"]:
            out.append({"where": where, "kind": kind, "requests": d["requests"],
                        "bank_conflict_wavefronts": d["units"] - d["ideal"],
                        "wavefronts_per_request": d["units"] / max(d["requests"], 1)})
    return sorted(out, key=lambda x: -x["requests"])


def profile_step(recs, meta, step: str, n_tokens: int, kv_lens, figures) -> dict:
    by_kernel: dict[str, list] = defaultdict(list)
    for r in recs:
        by_kernel[r["kernel"]].append(r)
    devices = {}
    per_launch = {dev.name: [est.launch_estimate(r, dev) for r in recs] for dev in est.DEVICES}
    for dev in est.DEVICES:
        e = per_launch[dev.name]
        total = sum(x["us"] for x in e)
        work = sum(x["work_us"] for x in e)
        if step == "decode":
            from .roofline import decode_step_bytes
            roof = decode_step_bytes(meta, kv_lens) / dev.hbm_bytes_per_s * 1e6
        else:
            roof = prefill_roofline(meta, n_tokens, dev)
        devices[dev.name] = {"estimated_us": total, "estimated_us_without_fixed": work,
                             "roofline_us": roof, "roofline_fraction": roof / total,
                             "roofline_fraction_without_fixed": roof / work if work else None}
    kernels = []
    for name, rs in by_kernel.items():
        idx = [i for i, r in enumerate(recs) if r["kernel"] == name]
        row = {"kernel": name, "launches": len(rs),
               "grid": list(rs[0]["grid"]), "block": list(rs[0]["block"]),
               "blocks_run_per_launch": rs[0]["counters"]["blocks"]}
        for dev in est.DEVICES:
            e = [per_launch[dev.name][i] for i in idx]
            lim = defaultdict(float)
            for x in e:
                lim[x["limiter"]] += x["us"]
            row[dev.name] = {"estimated_us": sum(x["us"] for x in e),
                             "limiter": max(lim, key=lim.get),
                             "dram_bytes": sum(x["dram_read"] + x["dram_written"] for x in e),
                             "tensor_flops": sum(x["flops"] for x in e)}
        tot = _sum_counters(rs)
        row["counters_scaled_to_grid"] = tot
        row.update(est.efficiency(tot))
        fig = figures.get(name)
        if fig:
            threads = math.prod(rs[0]["block"])
            row["registers"] = fig["registers"]
            row["static_shared_bytes"] = fig["shared_bytes"]
            row["occupancy_h100"] = est.occupancy(
                est.H100, threads, fig["registers"], fig["shared_bytes"] + rs[0]["shared_mem"])
        row["hot_spots"] = _hot_spots(rs)[:6]
        # per distinct scalar arguments (e.g. a GEMM's m, n, k): what one launch costs
        variants: dict[tuple, list] = defaultdict(list)
        for i in idx:
            variants[tuple(recs[i].get("scalars", ()))].append(i)
        row["variants"] = [{"scalars": list(sc), "launches": len(ii),
                            **{dev.name: per_launch[dev.name][ii[0]]["us"]
                               for dev in est.DEVICES}}
                           for sc, ii in variants.items()]
        kernels.append(row)
    kernels.sort(key=lambda k: -k[est.H200.name]["estimated_us"])
    return {"launches": len(recs), "tokens": n_tokens, "devices": devices, "kernels": kernels}


def profile_preset(preset: str, *, batch: int = 1, context: int = 1024,
                   prefill_len: int = 512, sample_blocks: int = 16, full_grid: int = 512,
                   prefill_sample_blocks: int = 4, figures=None, on_progress=None) -> dict:
    """Counters and estimates of a decode and a prefill step of `preset` (see module doc).
    A prefill block does a whole tile's tensor-core work (seconds on the emulator), so fewer
    of its blocks are sampled. `on_progress(text)` is told of each phase as it ends (the
    emulator's kernel builds say themselves)."""
    def said(text):
        if on_progress is not None:
            on_progress(f"{preset}: {text}")
    t0 = time.perf_counter()
    trace, meta = record(preset, batch=batch, context=context, prefill_len=prefill_len)
    said(f"recorded a prefill of {prefill_len} and a decode step of batch {batch}")
    figures = nvrtc_figures(on_progress) if figures is None else figures
    out = {"preset": preset, "batch": batch, "context": context, "prefill_len": prefill_len,
           "sample_blocks": sample_blocks, "prefill_sample_blocks": prefill_sample_blocks,
           "full_grid": full_grid, "steps": {}}
    for step in ("decode", "prefill"):
        be = (ProfileEmuBackend(sample_blocks, full_grid) if step == "decode"
              else ProfileEmuBackend(prefill_sample_blocks, 0))
        recs = [r for r in replay(trace, step, be) if "counters" in r]
        n_tokens = batch if step == "decode" else prefill_len
        out["steps"][step] = profile_step(recs, meta, step, n_tokens, [context + 1] * batch,
                                          figures)
        said(f"{step} step counted on the emulator ({len(recs)} launches)")
    out["seconds"] = time.perf_counter() - t0
    return out


def report(presets: list[dict]) -> dict:
    return {
        "estimate": True,
        "what": "ESTIMATED kernel and step times on H100/H200 from EmuBackend hardware "
                "counters (metrale/gpu_runtime/emu/counters.h, estimate.py); not measured "
                "on a GPU",
        "model": {"fixed_us_per_launch": est.FIXED_US,
                  "devices": [est.device_dict(d) for d in est.DEVICES],
                  "sampling": "grids of up to full_grid blocks run whole; larger grids run "
                              "sample_blocks evenly spaced blocks, scaled by the grid; "
                              "launches that repeat (the layers) are counted once"},
        "presets": presets,
    }


def format_report(rep: dict) -> str:
    """The human-readable table `check-kernels --profile` prints."""
    lines = ["ESTIMATE (EmuBackend counters, not a GPU measurement): "
             f"fixed {rep['model']['fixed_us_per_launch']} us per launch + max(DRAM, tensor "
             "core, shared memory) at published H100/H200 peaks"]
    for p in rep["presets"]:
        for step, s in p["steps"].items():
            desc = (f"decode batch {p['batch']} at {p['context']} cached tokens" if step == "decode"
                    else f"prefill of {p['prefill_len']} tokens")
            lines.append(f"\n{p['preset']}: {desc}, {s['launches']} launches")
            for dev, d in s["devices"].items():
                lines.append(f"  {dev}: {d['estimated_us']:9.1f} us estimated "
                             f"({d['estimated_us_without_fixed']:.1f} without the fixed cost), "
                             f"roofline {d['roofline_us']:.1f} us -> "
                             f"{d['roofline_fraction']:.2f} of the roofline")
            lines.append(f"  {'kernel':<40} {'n':>4} {'H100 us':>9} {'H200 us':>9} "
                         f"{'limiter':<14} {'ld eff':>6} {'bank cf':>8} {'occ':>4}")
            for k in s["kernels"]:
                h1, h2 = k[est.H100.name], k[est.H200.name]
                eff = k["gld_sector_efficiency"]
                occ = k.get("occupancy_h100", {}).get("warps_per_sm", "")
                conflicts = k["shared_bank_conflicts"] + k["ldmatrix_bank_conflicts"]
                lines.append(f"  {k['kernel']:<40} {k['launches']:>4} {h1['estimated_us']:>9.1f} "
                             f"{h2['estimated_us']:>9.1f} {h2['limiter']:<14} "
                             f"{'' if eff is None else f'{eff:.0%}':>6} {conflicts:>8.0f} "
                             f"{occ:>4}")
                for h in k["hot_spots"][:3]:
                    what = (f"{h['sector_efficiency']:.0%} sector efficiency"
                            if "sector_efficiency" in h
                            else f"{h['wavefronts_per_request']:.1f} wavefronts/request")
                    lines.append(f"      {h['kind']} at {h['where']}: {what}")
    return "\n".join(lines)
