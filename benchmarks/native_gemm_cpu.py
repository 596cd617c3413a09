#!/usr/bin/env python3
"""The CPU backend's native GEMM (gpu_runtime/native) at the linears of real models, this
tree's library against the library built from another git revision, interleaved.

    python benchmarks/native_gemm_cpu.py [--baseline-rev REV] [--m 1 128]
                                         [--formats bf16 q4 fp8 q4_1 q4_k ...]
                                         [--cold-mib 128] [--avx2] [--json FILE]

Shapes (n, k) are the linears of SmolLM2-135M (hidden 576, intermediate 1536, 9 heads / 3
KV heads of 64, vocab 49152) and Qwen2.5-0.5B (896, 4864, 14 / 2 heads of 64, vocab
151936), q/k/v and gate/up fused as the model path runs them; the LM head only at m = 1
(prefill computes the last row's logits). W is random: BF16 bits, 4-bit (group 128, FP16
scales, uint8 zeros) or FP8 e4m3 with 128x128 block scales, as ops.gemm_q passes them, or
a GGUF type's planes (ops/gguf_planes.py; random codes, f16 scales of moderate size) as
ops.gemm_gguf passes them, at the shapes whose k is a multiple of the type's block (the
K-quants skip k = 576, 896, as llama.cpp's quantizer does). --avx2 measures the library
built without AVX-512 (gemm_avx2.h's tiles: the stand-in for an AVX2-only CPU).
Every measurement is the median of `--reps` calls (at least ~0.2 s of calls each), rounds
alternate the libraries so a busy machine slows both alike; the library threads are the
process's usable CPUs. Without --cold-mib a small W stays in the caches between calls;
decode reads every weight once a step, from DRAM, which --cold-mib reproduces (the calls
rotate over copies of W filling that many MiB). Reported: ms per call, GMAC/s and GB/s of
W read. The 1-minute load average is recorded before and after: on a shared machine
numbers are indicative only.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.formats.gguf.packed import split_blocks  # noqa: E402
from metrale.gpu_runtime import native  # noqa: E402
from metrale.gpu_runtime.cxx import compiler  # noqa: E402
from metrale.ops.bf16 import f32_to_bf16  # noqa: E402
from metrale.ops.gguf_planes import PACKED  # noqa: E402

GGUF = {t.name.lower(): i for i, t in PACKED.items()}
# byte offsets of the f16 fields in a stored block (ggml-common.h)
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
          "IQ4_NL": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208], "IQ4_XS": [0]}


def gguf_planes(ggml_type: int, n: int, k: int, rng):
    """Planes (q, qh or None, meta) of random stored blocks with f16 scales in [2^-8, 2^-4)."""
    t = PACKED[ggml_type]
    b = rng.integers(0, 256, (n * k // t.qk, t.block_bytes), dtype=np.uint8)
    for a in F16_AT[t.name]:
        h = (2.0 ** rng.uniform(-8, -4, len(b))).astype(np.float16)
        b[:, a:a + 2] = h.view(np.uint8).reshape(-1, 2)
    p = split_blocks(b.reshape(-1), ggml_type, n, k)
    return p.q, p.qh, p.meta

# model -> [(linear, n, k)]
SHAPES = {
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                     ("down", 576, 1536), ("lm_head", 49152, 576)],
    "qwen2.5-0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896),
                     ("down", 896, 4864), ("lm_head", 151936, 896)],
}
GROUP, BLOCK = 128, 128


def build_revision(rev: str, out_dir: Path) -> Path:
    """The native library of git revision `rev`, built with this tree's flags."""
    root = Path(__file__).resolve().parents[1]
    src_dir = "metrale/gpu_runtime/native"
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{src_dir}"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{src_dir}/{name}"], cwd=root,
                              capture_output=True, check=True).stdout
        (out_dir / name).write_bytes(blob)
    sources = [str(out_dir / n) for n in names if n.endswith(".cpp")]
    lib = out_dir / "baseline.so"
    subprocess.run([compiler(), *native.FLAGS, *native.TUNE, *sources, "-o", str(lib)],
                   check=True, capture_output=True)
    return lib


def make_call(fmt: str, x: np.ndarray, n: int, k: int, rng, cold_bytes: int = 0):
    """(call(lib): one GEMM, bytes of W it reads). With cold_bytes, the calls rotate over
    enough copies of W to fill that many bytes, so each reads its W from DRAM as a decode
    step does (one pass over every weight) instead of from the caches."""
    m = len(x)
    out = np.empty((m, n), np.float32)
    if fmt == "bf16":
        def make():
            return (f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32)),)
        run = lambda lib, w: lib.gemm(x, *w, out)   # noqa: E731
    elif fmt == "q4":   # [n, ceil(k / 32) * 4] uint32 words, FP16 scales, uint8 zeros
        def make():
            q = rng.integers(0, 2**32, (n, (k + 31) // 32 * 4), dtype=np.uint32)
            groups = -(-k // GROUP)
            scales = (rng.uniform(0.005, 0.02, (n, groups)).astype(np.float16)).view(np.uint16)
            return q, scales, rng.integers(0, 16, (n, groups), dtype=np.uint8)
        run = lambda lib, w: lib.gemm_q4(x, *w, None, None, k, GROUP, out)   # noqa: E731
    elif fmt in GGUF:
        ggml_type = GGUF[fmt]

        def make():
            return tuple(a for a in gguf_planes(ggml_type, n, k, rng) if a is not None)

        def run(lib, w):
            q, qh, meta = (w[0], w[1], w[2]) if len(w) == 3 else (w[0], None, w[1])
            lib.gemm_gguf_at(ggml_type, x.ctypes.data, q.ctypes.data,
                             0 if qh is None else qh.ctypes.data, meta.ctypes.data, m, n, k,
                             n, out.ctypes.data, True)
    else:   # fp8: e4m3 codes without the NaN ones, float32 scales per 128 x 128 block
        def make():
            q = rng.integers(0, 256, (n, (k + 31) // 32 * 32), dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] = 0x3C
            scales = rng.uniform(0.001, 0.01, (-(-n // BLOCK), -(-k // BLOCK))).astype(np.float32)
            return q, scales, (np.arange(n) // BLOCK).astype(np.int32)
        run = lambda lib, w: lib.gemm_fp8(x, *w, k, BLOCK, out)   # noqa: E731
    copies = [make()]
    nbytes = sum(a.nbytes for a in copies[0])
    while len(copies) * nbytes < cold_bytes:
        copies.append(tuple(a.copy() for a in copies[0]))
    turn = itertools.count()
    return (lambda lib: run(lib, copies[next(turn) % len(copies)])), nbytes


def median_call_s(call, reps: int, min_s: float = 0.2) -> float:
    call()   # warm: W and the library's pool
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", help="git revision whose native library to compare")
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 128])
    ap.add_argument("--formats", nargs="+", default=["bf16"],
                    choices=["bf16", "q4", "fp8", *GGUF])
    ap.add_argument("--avx2", action="store_true",
                    help="this tree's library built without AVX-512 (-mno-avx512f)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold-mib", type=int, default=0,
                    help="rotate over copies of W filling this many MiB (e.g. 256, past the "
                         "caches: each call reads W from DRAM, as decode does)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    libs = {"this": native.NativeKernels(native._build((*native.TUNE, "-mno-avx512f")))
            if args.avx2 else native.load()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            libs[args.baseline_rev] = native.NativeKernels(build_revision(args.baseline_rev,
                                                                          Path(tmp)))
        before = loadavg()
        rng = np.random.default_rng(0)
        cases = []   # (model, linear, fmt, m, n, k, {lib: call}, bytes)
        for model in args.models:
            for linear, n, k in SHAPES[model]:
                for m in args.m:
                    if linear == "lm_head" and m > 1:
                        continue
                    x = f32_to_bf16(rng.standard_normal((m, k), dtype=np.float32))
                    for fmt in args.formats:
                        if fmt in GGUF and k % PACKED[GGUF[fmt]].qk:
                            continue
                        call, nbytes = make_call(fmt, x, n, k, np.random.default_rng(1),
                                                 args.cold_mib << 20)
                        calls = {name: functools.partial(call, lib)
                                 for name, lib in libs.items()}
                        cases.append((model, linear, fmt, m, n, k, calls, nbytes))
        times = {(i, name): [] for i in range(len(cases)) for name in libs}
        for _ in range(args.rounds):
            for i, case in enumerate(cases):
                for name, call in case[6].items():
                    times[i, name].append(median_call_s(call, args.reps))
        rows = []
        for i, (model, linear, fmt, m, n, k, _, nbytes) in enumerate(cases):
            row = {"model": model, "linear": linear, "format": fmt, "m": m, "n": n, "k": k,
                   "w_bytes": nbytes}
            for name in libs:
                t = statistics.median(times[i, name])
                row[name] = {"ms": round(t * 1e3, 4), "gmac_s": round(m * n * k / t / 1e9, 2),
                             "w_gb_s": round(nbytes / t / 1e9, 2)}
            if args.baseline_rev:
                row["speedup"] = round(row[args.baseline_rev]["ms"] / row["this"]["ms"], 2)
            rows.append(row)
            line = f"{model:13s} {linear:8s} {fmt:5s} m={m:<4d} n={n:<6d} k={k:<5d}"
            for name in libs:
                line += f" | {name}: {row[name]['ms']:9.3f} ms {row[name]['gmac_s']:6.2f} GMAC/s"
            if args.baseline_rev:
                line += f" | x{row['speedup']}"
            print(line, flush=True)
    from metrale.bench.env import cpu_info
    report = {"benchmark": "native_gemm_cpu", "cpu": cpu_info(), "gemm_kind": libs["this"].kind,
              "build": "-march=native -mno-avx512f" if args.avx2 else "-march=native",
              "threads": native.usable_cpus(), "baseline_rev": args.baseline_rev,
              "cold_mib": args.cold_mib,
              "rounds": args.rounds, "loadavg_before": before, "loadavg_after": loadavg(),
              "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"load average before {before}, after {report['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
