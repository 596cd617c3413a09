#!/usr/bin/env python3
"""metrale against Hugging Face transformers on identical random weights, ratios from one run.

    python benchmarks/compare_hf.py [--preset llama-3.1-8b] [--device cuda] [--batch 1,8]
        [--prompt-len 512] [--gen-len 64] [--compile-batches 1] [--json FILE]

The HF model is built from the same config dict (`metrale.formats.PRESETS`) and every
parameter is overwritten with the same BF16 bits metrale loads (`MemorySource.read_bf16`
per HF key), so both run the same weights; a logits check on one prompt proves it.

Per batch size, the same random prompts go through:
- metrale: each prompt prefilled on its own (pointer API), then `gen_len` greedy
  `decode_batch` steps with the device argmax (as `metrale bench`);
- HF eager (`generate`, dynamic cache, greedy, SDPA attention);
- HF static cache + `torch.compile(mode="reduce-overhead")` for the batch sizes in
  `--compile-batches` (each new shape compiles again, which takes minutes on 8B models).
HF times come from one greedy `generate(gen_len tokens)` per repetition, timestamped per token
by a streamer: prefill = time to the first new token, decode = mean time between tokens.
torch is imported only here: it is not a metrale dependency.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.bench.env import environment  # noqa: E402
from metrale.formats import MemorySource, preset_config  # noqa: E402


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",")]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive ints, comma-separated")
    return out


def build_hf_model(torch, transformers, preset: str, source, device: str):
    """HF model from the preset's config dict with every parameter copied from `source`."""
    cfg, _ = preset_config(preset)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.torch_dtype = torch.bfloat16
    kwargs = {"attn_implementation": "sdpa"}
    # Random init on the target device is fast; every weight is overwritten below.
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, torch_dtype=torch.bfloat16, **kwargs)
        except TypeError:  # older transformers: no attn_implementation for from_config
            model = transformers.AutoModelForCausalLM.from_config(config,
                                                                  torch_dtype=torch.bfloat16)
    model.eval()
    state = model.state_dict()
    names = source.tensor_names()
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"HF model has no parameter for {missing[:5]} (of {len(missing)})")
    with torch.no_grad():
        for name in names:
            bits = np.ascontiguousarray(source.read_bf16(name))
            t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            dst = state[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"{name}: HF shape {tuple(dst.shape)} != {tuple(t.shape)}")
            dst.copy_(t.to(dst.device, non_blocking=False))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    untouched = [n for n in state if n not in set(names) and not n.endswith("lm_head.weight")]
    return model, untouched


class _Clock:
    """A `generate` streamer that only timestamps: put() is called with the prompt, then
    once per generated token (after the token is on the host)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate_times(torch, model, prompts, gen_len: int, reps: int, static: bool) -> dict:
    """Prefill time (to the first new token) and per-step decode times of greedy
    `generate(gen_len tokens)`, timestamped by a streamer; medians over `reps` after one
    warm-up call (which compiles under torch.compile; the static cache length, prompt +
    gen_len, is the same in every call, so nothing recompiles while timing)."""
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
              use_cache=True, max_new_tokens=gen_len, min_new_tokens=gen_len)
    if static:
        kw["cache_implementation"] = "static"

    def run():
        clock = _Clock()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, streamer=clock, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        new = clock.stamps[1:]  # stamps[0]: the prompt
        return new[0] - t0, [b - a for a, b in zip(new, new[1:])]

    run()
    runs = [run() for _ in range(reps)]
    t_pre = statistics.median(r[0] for r in runs)
    step = statistics.median(sum(r[1]) / max(len(r[1]), 1) for r in runs)
    B, P = ids.shape
    return {"prefill_s": t_pre, "prefill_tokens_per_s": B * P / t_pre,
            "decode_step_ms": step * 1e3,
            "decode_tokens_per_s": B / step if step > 0 else None}


def metrale_times(model, prompts, gen_len: int, reps: int) -> dict:
    stream = model.default_stream()
    B = len(prompts)

    def once():
        seqs = [model.alloc_sequence() for _ in range(B)]
        try:
            t0 = time.perf_counter()
            toks = [model.argmax_on_device(model.prefill(p, s, stream), stream)
                    for p, s in zip(prompts, seqs)]
            t_pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(gen_len - 1):
                toks = model.argmax_batch(model.decode_batch(toks, seqs, stream), B, stream)
            t_dec = time.perf_counter() - t0
        finally:
            for s in seqs:
                model.free_sequence(s)
        return t_pre, t_dec

    once()  # warm-up: kernels, the decode graph of this batch size
    runs = [once() for _ in range(reps)]
    t_pre = statistics.median(r[0] for r in runs)
    t_dec = statistics.median(r[1] for r in runs)
    steps = max(gen_len - 1, 1)
    P = len(prompts[0])
    return {"prefill_s": t_pre, "prefill_tokens_per_s": B * P / t_pre,
            "decode_step_ms": t_dec / steps * 1e3, "decode_tokens_per_s": B * steps / t_dec}


def logits_check(torch, hf, model, prompt) -> dict:
    """Last-position logits of one prompt from both models."""
    dev = next(hf.parameters()).device
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device=dev)).logits[0, -1].float().cpu().numpy()
    seq = model.alloc_sequence()
    try:
        ptr = model.prefill(prompt, seq, model.default_stream())
        V = model.vocab_size()
        row = np.empty(V, np.float32 if model.logits_ptr_is_fp32(ptr) else np.uint16)
        model.copy_logits_to_host(ptr, row)
    finally:
        model.free_sequence(seq)
    if row.dtype == np.uint16:
        row = (row.astype(np.uint32) << 16).view(np.float32)
    err = float(np.max(np.abs(row - ref)) / max(float(np.max(np.abs(ref))), 1e-12))
    return {"rel_max_err": err, "argmax_metrale": int(np.argmax(row)),
            "argmax_hf": int(np.argmax(ref)), "argmax_agree": int(np.argmax(row)) == int(
                np.argmax(ref))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu (torch and metrale)")
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compile-batches", type=_ints, default=[1],
                    help="batch sizes for the static-cache + torch.compile run (default 1)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.gen_len < 2 or args.prompt_len < 1 or args.reps < 1:
        ap.error("--gen-len must be >= 2, --prompt-len and --reps >= 1")
    t_start = time.perf_counter()
    import metrale
    from metrale.gpu_runtime import backend as pick_backend
    be = pick_backend(args.device)
    report = environment(be)
    report.update({"command": "compare_hf.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
                   "preset": args.preset, "prompt_len": args.prompt_len,
                   "gen_len": args.gen_len, "results": [], "errors": []})

    def save():
        report["wall_s"] = time.perf_counter() - t_start
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    try:
        import torch
        import transformers
    except ImportError as e:
        report["errors"].append(f"torch/transformers not importable: {e}")
        save()
        print(report["errors"][-1], file=sys.stderr)
        return 1
    report["torch"] = torch.__version__
    report["transformers"] = transformers.__version__
    tdev = "cuda:" + str(getattr(be, "device_id", 0)) if be.name.startswith("cuda") else "cpu"
    source = MemorySource.preset(args.preset)
    bmax = max(args.batch)
    seq_cap = args.prompt_len + args.gen_len + 16
    t0 = time.perf_counter()
    model = metrale.load(source, be, max_batch=bmax,
                         kv_blocks=bmax * (-(-seq_cap // 16) + 1) + 8, max_seq_len=seq_cap,
                         max_prefill_tokens=max(16, min(args.prompt_len, 4096)))
    report["metrale_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf, untouched = build_hf_model(torch, transformers, args.preset, source, tdev)
    report["hf_load_s"] = time.perf_counter() - t0
    report["hf_params_not_from_source"] = untouched
    rng = np.random.default_rng(0)
    V = source.metadata().vocab_size
    try:
        report["logits_check"] = logits_check(torch, hf, model,
                                              rng.integers(0, V, min(args.prompt_len, 64))
                                              .tolist())
    except Exception as e:
        report["errors"].append(f"logits check: {type(e).__name__}: {e}")
    def ratios_of(row) -> dict:
        out, m = {}, row.get("metrale")
        for other in ("hf_eager", "hf_compiled"):
            o = row.get(other)
            if m and o:
                for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                    if m.get(k) and o.get(k):
                        out[f"{k}_vs_{other}"] = m[k] / o[k]
        return out

    # Pass 1: metrale and HF eager at every batch size (saved after each, so a timeout
    # during the slow compile pass below keeps them).
    prompts_of = {}
    for B in args.batch:
        prompts = prompts_of[B] = rng.integers(0, V, (B, args.prompt_len)).tolist()
        row = {"batch": B, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
               "hf_compiled": None}
        for key, fn in (("metrale", lambda: metrale_times(model, prompts, args.gen_len,
                                                          args.reps)),
                        ("hf_eager", lambda: hf_generate_times(torch, hf, prompts, args.gen_len,
                                                               args.reps, static=False))):
            try:
                row[key] = fn()
            except Exception as e:
                row[key] = None
                report["errors"].append(f"batch {B} {key}: {type(e).__name__}: {e}")
                traceback.print_exc()
        row["ratios"] = ratios_of(row)
        report["results"].append(row)
        save()
        print(json.dumps({"batch": B, **row["ratios"]}), flush=True)
    # Pass 2: HF static cache + torch.compile (each new batch shape compiles again).
    if not args.no_compile and hasattr(torch, "compile"):
        eager_forward = hf.forward
        compiled = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=False)
        for row in report["results"]:
            B = row["batch"]
            if B not in args.compile_batches:
                continue
            hf.forward = compiled
            try:
                row["hf_compiled"] = hf_generate_times(torch, hf, prompts_of[B], args.gen_len,
                                                       args.reps, static=True)
            except Exception as e:
                report["errors"].append(f"batch {B} hf_compiled: {type(e).__name__}: {e}")
                traceback.print_exc()
            finally:
                hf.forward = eager_forward
            row["ratios"] = ratios_of(row)
            save()
            print(json.dumps({"batch": B, **row["ratios"]}), flush=True)
    model.teardown()
    save()
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
