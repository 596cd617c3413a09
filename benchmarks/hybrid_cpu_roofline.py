#!/usr/bin/env python3
"""Batch-1 decode of a hybrid model on the CPU against the byte roofline of this machine.

    python benchmarks/hybrid_cpu_roofline.py [--preset qwen3.5-0.8b] [--prompt-len 128]
        [--gen-len 16] [--reps 3] [--json FILE]

A decode step must read every weight (the tied embedding as the head: whole), each recurrent
layer's FP32 state and conv window (read and written) and the K/V of the full-attention
layers (bench/roofline.py `model_step_bytes`). The roofline is the host's copy bandwidth
(2 * bytes / time of numpy copies, one per thread the GEMMs use, best of 5), measured in
the same run, interleaved with the decode repetitions (after three untimed repetitions: the
first ones after a load run up to 2x slower here): `fraction = step bytes x tokens/s / copy
bandwidth` (1.0: the step ran at the speed of copying the bytes it must read).
The step's time per kind of launch (GEMMs, the recurrent kernels, the rest) comes from one
profiled step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import metrale  # noqa: E402
from metrale.bench.env import environment  # noqa: E402
from metrale.bench.roofline import kv_bytes_per_token, model_step_bytes, state_step_bytes  # noqa: E402
from metrale.gpu_runtime import HostBackend  # noqa: E402
from metrale.gpu_runtime.native import usable_cpus  # noqa: E402


def copy_bandwidth(threads: int, nbytes: int = 1 << 28, reps: int = 5) -> float:
    """GB/s of `threads` concurrent numpy copies of nbytes / threads each (2 n / t)."""
    part = nbytes // threads
    src = [np.ones(part, np.uint8) for _ in range(threads)]
    dst = [np.ones(part, np.uint8) for _ in range(threads)]   # touched: no page faults timed
    best = float("inf")
    for _ in range(reps + 1):
        ts = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(dst, src)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * part * threads / best / 1e9


def decode_rep(m, prompt, gen_len: int) -> float:
    """Tokens/s of gen_len greedy decode steps after prefilling `prompt`."""
    seq = m.alloc_sequence()
    try:
        tok = m.argmax_on_device(m.prefill(prompt, seq, 0), 0)
        t0 = time.perf_counter()
        for _ in range(gen_len):
            tok = m.argmax_on_device(m.decode(tok, seq, 0), 0)
        return gen_len / (time.perf_counter() - t0)
    finally:
        m.free_sequence(seq)


def profile_step(m, prompt) -> dict:
    """Seconds of one decode step by kind of launch (HostBackend runs launches in order)."""
    import cProfile
    import pstats
    seq = m.alloc_sequence()
    tok = m.argmax_on_device(m.prefill(prompt, seq, 0), 0)
    pr = cProfile.Profile()
    pr.enable()
    m.argmax_on_device(m.decode(tok, seq, 0), 0)
    pr.disable()
    m.free_sequence(seq)
    st = pstats.Stats(pr).stats
    total = sum(v[2] for v in st.values())
    gemm = sum(v[2] for (f, _, name), v in st.items() if f.endswith("native.py") and name == "gemm")
    rec = sum(v[2] for (f, _, name), v in st.items()
              if f.endswith(("native_recurrent.py", "causal_conv1d.py")) and
              name in ("gdr_step", "_update_twin"))
    return {"total_s": total, "gemm_s": gemm, "recurrent_s": rec,
            "other_s": total - gemm - rec}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    be = HostBackend()
    m = metrale.load(f"preset:{args.preset}", be, progress=False, max_batch=1,
                     kv_blocks=-(-(args.prompt_len + args.gen_len + 2) // 16) + 2,
                     max_prefill_tokens=max(args.prompt_len, 16))
    prompt = np.random.default_rng(0).integers(4, m.vocab_size(), args.prompt_len).tolist()
    threads = usable_cpus()   # the threads the native GEMMs run on
    for _ in range(3):   # warm-up: the first repetitions after a load run up to 2x slower
        decode_rep(m, prompt, args.gen_len)
    toks, bws = [], []
    for _ in range(args.reps):   # interleaved: the roofline and the decode, alternately
        bws.append(copy_bandwidth(threads))
        toks.append(decode_rep(m, prompt, args.gen_len))
    meta = m.metadata()
    kv_len = args.prompt_len + args.gen_len // 2   # the middle of the timed steps
    step = model_step_bytes(m, [kv_len])
    tok_s, bw = statistics.median(toks), statistics.median(bws)
    report = environment(be)
    report.update({
        "command": "hybrid_cpu_roofline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "threads": threads, "decode_tokens_per_s": tok_s, "decode_tokens_per_s_reps": toks,
        "copy_bandwidth_gb_s": bw, "copy_bandwidth_gb_s_reps": bws,
        "step_bytes": step, "weight_bytes": int(m.weight_bytes()),
        "state_bytes_read_written": state_step_bytes(meta),
        "kv_bytes": kv_len * kv_bytes_per_token(meta),
        "achieved_gb_s": step * tok_s / 1e9,
        "roofline_fraction": step * tok_s / 1e9 / bw,
        "step_profile": profile_step(m, prompt),
    })
    print(f"{args.preset}: batch-1 decode {tok_s:.2f} tok/s; a step reads {step / 1e9:.3f} GB "
          f"(weights {report['weight_bytes'] / 1e9:.3f}, state r+w "
          f"{report['state_bytes_read_written'] / 1e6:.1f} MB, KV {report['kv_bytes'] / 1e6:.2f}"
          f" MB): {report['achieved_gb_s']:.2f} GB/s against a copy bandwidth of {bw:.2f} GB/s "
          f"({threads} threads) = {report['roofline_fraction']:.2f} of the roofline")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    m.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
