#!/usr/bin/env python3
"""ESTIMATE (not a measurement) of the Q4_K decode GEMV over GGUF weights at their bytes on
H100 / H200, against the byte roofline, from the EmuBackend's counters.

    python benchmarks/emu_estimate_gguf.py [--json FILE] [--no-nvrtc]

The kernel is gemm_gguf_q4_k_bf16_16x16 (kernels/gemm_gguf_k.cu, the decode tile) at m = 1 on
an 8B model's two shapes of the FFN (Llama 3.1 8B: n = 14336, k = 4096 one half of gate|up;
n = 4096, k = 14336 down), with the BF16 gemm_tc decode tile at the same shapes for
comparison. Each launch runs on ProfileEmuBackend (gpu_runtime/emu/trace.py: counters on,
16 evenly spaced blocks of the grid, scaled to it) and gpu_runtime/emu/estimate.py turns its
counters into a time per device: a fixed 2 us per launch plus the largest of DRAM bytes at
the published HBM bandwidth, tensor-core FLOPs at the dense peak and shared-memory wavefronts
at one per SM clock. The roofline is the bytes the GEMV must move (the Q4_K planes, 144 bytes
per 256 weights, plus X and Y) at the HBM bandwidth; the fraction is roofline / estimate.
Not counted (estimate.py's limits): instruction issue and CUDA-core arithmetic -- here the
dequantization (about four FP32 / integer instructions per weight) -- and memory latency, so
the figure is an upper bound on what the kernel can reach; the report adds, separately
labelled, the time instruction issue alone would take from the decode k loop's static PTX
instruction count on the decode path (m <= 8, aligned X). Values of the weights do not change
the work: the planes are the profile backend's zero pages. Nothing here ran on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.gpu_runtime import NULL  # noqa: E402
from metrale.gpu_runtime.emu import estimate as est  # noqa: E402
from metrale.gpu_runtime.emu.trace import ProfileEmuBackend  # noqa: E402
from metrale.ops import gemm_gguf, gemm_tc  # noqa: E402
from metrale.ops.gguf_planes import PACKED, plane_bytes  # noqa: E402

Q4_K = next(t for t, p in PACKED.items() if p.name == "Q4_K")
SHAPES = [("gate or up (n 14336, k 4096)", 14336, 4096), ("down (n 4096, k 14336)", 4096, 14336)]
SAMPLE_BLOCKS = 16


def nvrtc_figures() -> dict:
    """kernel name -> ptxas figures (sm_90) of the two kernels' files; {} without NVRTC."""
    from metrale.gpu_runtime import kernel_source
    out = {}
    try:
        for module in (gemm_gguf.MODULE_K, gemm_tc.MODULE):
            _, log = kernel_source.compile_cubin(module, "sm_90")
            out.update({k["name"]: k for k in kernel_source.parse_ptxas(log)})
    except Exception:   # no NVRTC here: occupancy is left out
        return {}
    return out


# basic blocks a decode step (m <= 8, X 16-byte aligned) never runs: the scalar X fill
# (unaligned X) and the X path of 9-16 rows (ldmatrix .x4)
NOT_ON_DECODE_PATH = ("ld.global.u16", "ldmatrix.sync.aligned.m8n8.x4")


def ptx_loop_instructions(module: str, entry: str) -> int | None:
    """Instructions (static PTX, before ptxas) in the body of `entry`'s k loop -- the loop
    whose back edge jumps over the mma.sync instructions -- leaving out its basic blocks of
    NOT_ON_DECODE_PATH; the edge branches (k, rows past n) stay in. None without NVRTC."""
    import re
    try:
        from cuda.bindings import nvrtc
        from metrale.gpu_runtime import kernel_source
        src, _ = kernel_source.read_source(module)
        opts = ["--gpu-architecture=compute_90", *kernel_source.NVRTC_OPTIONS,
                f"-I{kernel_source.kernels_dir()}", f"-I{kernel_source.cuda_include_dir()}"]
        prog = nvrtc.nvrtcCreateProgram(src.encode(), f"{module}.cu".encode(), 0, [], [])[1]
        if nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0] != 0:
            return None
        buf = b" " * nvrtc.nvrtcGetPTXSize(prog)[1]
        nvrtc.nvrtcGetPTX(prog, buf)
        nvrtc.nvrtcDestroyProgram(prog)
    except Exception:
        return None
    ptx = buf.decode(errors="replace")
    body = ptx[ptx.index(f".entry {entry}("):]
    nxt = body.find(".entry ", 10)
    lines = (body if nxt < 0 else body[:nxt]).split("\n")
    labels = {m.group(1): i for i, ln in enumerate(lines)
              if (m := re.match(r"^(\$L__BB\d+_\d+):", ln))}
    mma = [i for i, ln in enumerate(lines) if "mma.sync" in ln]
    for i, ln in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and labels[m.group(1)] < mma[0] and i > mma[-1]:
            blocks, cur = [], []
            for x in lines[labels[m.group(1)]:i + 1]:
                if re.match(r"^\$L__BB\d+_\d+:", x) and cur:
                    blocks.append(cur)
                    cur = []
                cur.append(x)
            blocks.append(cur)
            return sum(1 for blk in blocks
                       if not any(mark in x for x in blk for mark in NOT_ON_DECODE_PATH)
                       for x in blk
                       if x.strip() and not x.strip().startswith(("$", "//", "{", "}", ".")))
    return None


def profile(be, fn) -> dict:
    fn()
    be.synchronize(be.default_stream())
    return be.launch_counters[-1]


def estimate_row(rec: dict, roof_bytes: int, figures: dict) -> dict:
    c = rec["counters"]
    name = rec["kernel"].split(".")[-1]
    row = {"kernel": name, "grid": list(rec["grid"]), "block": list(rec["block"]),
           "blocks_run": c["blocks"], "roofline_bytes": roof_bytes}
    row.update({k: v for k, v in est.efficiency(c).items()
                if k in ("gld_sector_efficiency", "shared_bank_conflicts",
                         "ldmatrix_bank_conflicts")})
    fig = figures.get(name)
    if fig:
        threads = int(np.prod(rec["block"]))
        row["registers"] = fig["registers"]
        row["static_shared_bytes"] = fig["shared_bytes"]
        row["occupancy_h100"] = est.occupancy(est.H100, threads, fig["registers"],
                                              fig["shared_bytes"])
    for dev in est.DEVICES:
        e = est.launch_estimate(rec, dev)
        roof_us = roof_bytes / dev.hbm_bytes_per_s * 1e6
        row[dev.name] = {"estimated_us": e["us"], "estimated_us_without_fixed": e["work_us"],
                         "limiter": e["limiter"], "dram_bytes": e["dram_read"] + e["dram_written"],
                         "DRAM_us": e["DRAM_us"], "tensor_core_us": e["tensor_core_us"],
                         "shared_memory_us": e["shared_memory_us"], "roofline_us": roof_us,
                         "roofline_fraction": roof_us / e["us"],
                         "roofline_fraction_without_fixed": roof_us / e["work_us"]}
    return row


def run(use_nvrtc: bool = True) -> dict:
    be = ProfileEmuBackend(sample_blocks=SAMPLE_BLOCKS, full_grid=0)
    s = be.default_stream()
    figures = nvrtc_figures() if use_nvrtc else {}
    rows = []
    for label, n, k in SHAPES:
        q_row, _, meta_row = plane_bytes(Q4_K, k)
        x, y = be.alloc(k * 2), be.alloc(n * 2)
        q, meta, w = be.alloc(n * q_row), be.alloc(n * meta_row), be.alloc(n * k * 2)
        io = (k + n) * 2
        gguf = profile(be, lambda: gemm_gguf.gemm_gguf(be, s, y, x, q, NULL, meta, 1, n, k,
                                                        Q4_K, tile="16x16"))
        bf16 = profile(be, lambda: gemm_tc.gemm_tc(be, s, y, x, w, 1, n, k, tile="16x16"))
        rows.append({"shape": label, "m": 1, "n": n, "k": k,
                     "q4_k": estimate_row(gguf, n * (q_row + meta_row) + io, figures),
                     "bf16_gemm_tc": estimate_row(bf16, n * k * 2 + io, figures)})
        for p in (x, y, q, meta, w):
            be.free(p)
    loop = ptx_loop_instructions(gemm_gguf.MODULE_K, "gemm_gguf_q4_k_bf16_16x16") if use_nvrtc \
        else None
    issue = None
    if loop:
        # a CTA runs one warp: loop x stages x CTAs warp instructions, 4 issued per SM clock
        issue = {"ptx_instructions_per_stage": loop, "weights_per_stage": 16 * 64,
                 "instructions_per_weight": loop / 1024,
                 **{dev.name: {f"{r['shape']}": loop * (r["k"] // 64) * (r["n"] // 16)
                               / (4 * dev.sms * dev.clock_hz) * 1e6 for r in rows}
                    for dev in est.DEVICES},
                 "what": "ESTIMATED microseconds the decode tile's k loop would take if "
                         "instruction issue (4 warp instructions per SM clock) were the only "
                         "limit, from its static PTX instruction count on the decode path "
                         "(before ptxas, which fuses and drops some; the edge branches "
                         "counted). A limit the counters cannot see; settled only on a GPU"}
    return {
        "estimate": True,
        "what": "ESTIMATED time of the Q4_K decode GEMV (gemm_gguf_q4_k_bf16_16x16, m = 1) at "
                "Llama 3.1 8B FFN shapes on H100/H200 from EmuBackend counters "
                "(gpu_runtime/emu/estimate.py), against the byte roofline; the BF16 gemm_tc "
                "decode tile at the same shapes for comparison. Not measured on a GPU.",
        "not_counted": "instruction issue and CUDA-core arithmetic (the dequantization, about "
                       "four instructions per weight) and memory latency: the estimate is an "
                       "upper bound",
        "model": {"fixed_us_per_launch": est.FIXED_US,
                  "devices": [est.device_dict(d) for d in est.DEVICES],
                  "sampling": f"{SAMPLE_BLOCKS} evenly spaced blocks of each grid, counters "
                              "scaled to the grid"},
        "command": "python benchmarks/emu_estimate_gguf.py --json "
                   "benchmarks/results/emu_estimate_gguf_q4k_decode.json",
        "nvrtc_figures": bool(figures),
        "rows": rows,
        "issue_bound_estimate": issue,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the report as JSON")
    ap.add_argument("--no-nvrtc", action="store_true",
                    help="skip NVRTC (registers and occupancy left out)")
    args = ap.parse_args(argv)
    rep = run(not args.no_nvrtc)
    print("ESTIMATE (EmuBackend counters, not a GPU measurement)")
    for r in rep["rows"]:
        for key in ("q4_k", "bf16_gemm_tc"):
            e = r[key]
            for dev in est.DEVICES:
                d = e[dev.name]
                print(f"{r['shape']:<24} {key:<13} {dev.name:<20} {d['estimated_us']:8.1f} us "
                      f"(roofline {d['roofline_us']:7.1f} us, {d['limiter']}) -> "
                      f"{d['roofline_fraction']:.2f} of the roofline "
                      f"({d['roofline_fraction_without_fixed']:.2f} without the fixed cost)")
    iss = rep["issue_bound_estimate"]
    if iss:
        print(f"decode k loop: {iss['ptx_instructions_per_stage']} PTX instructions (static, "
              "decode path) per 1024 weights; instruction issue alone would take:")
        for dev in est.DEVICES:
            print(f"  {dev.name}: " + ", ".join(f"{k} {v:.1f} us"
                                               for k, v in iss[dev.name].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
