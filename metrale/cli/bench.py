"""`metrale bench MODEL`: prefill and decode throughput, latency, memory and roofline per
batch size (the harness is `metrale.bench`)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .args import (MODEL_HELP, add_device, batch_list, model_spec, nonneg_int, out_file,
                   positive_float, positive_int, preset_name)

DEFAULT_PROMPT_LEN, DEFAULT_GEN_LEN = 512, 128
SEQ_SLACK = 2   # positions the harness keeps free beyond prompt + generation


def register(sub) -> None:
    b = sub.add_parser("bench", help="throughput, latency, memory and roofline per batch size",
                       description="Prefill and decode benchmark per batch size: prefill and "
                       "decode tokens/s, TTFT, inter-token latency p50/p99, peak memory, and on "
                       "a GPU the achieved HBM GB/s and roofline fraction (decode bytes / step "
                       "time / measured copy bandwidth). Presets are random weights at real "
                       "shapes. On the CPU a time budget (--max-seconds, default 40) keeps the "
                       "defaults under a minute.")
    b.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", dest="model_option", metavar="MODEL",
                     help="the same as the positional MODEL")
    src.add_argument("--preset", type=preset_name, metavar="NAME",
                     help="random weights at a preset's shapes (tiny, llama-3.1-8b, ...); "
                          "the same as MODEL preset:NAME")
    add_device(b)
    b.add_argument("--batch", type=batch_list, default=(1, 8, 32, 64), metavar="1,8,32,64",
                   help="batch sizes, comma-separated (default 1,8,32,64)")
    b.add_argument("--prompt-len", type=positive_int, default=None,
                   help=f"prompt tokens per sequence (default {DEFAULT_PROMPT_LEN}, less when "
                        "the model has fewer positions)")
    b.add_argument("--gen-len", type=positive_int, default=None,
                   help=f"decode steps (default {DEFAULT_GEN_LEN}, less when the model has "
                        "fewer positions)")
    b.add_argument("--cache", choices=["paged", "contiguous"], default="paged",
                   help="KV cache: the paged pool or the contiguous baseline (default paged)")
    b.add_argument("--prefill", choices=["batched", "each"], default="batched",
                   help="batched: a batch's prompts share forward passes "
                        "(prefill_batch_chunk, up to 4096 tokens per pass; paged cache); "
                        "each: one prefill per sequence (default batched)")
    b.add_argument("--graphs", choices=["on", "off"], default=None,
                   help="CUDA graphs for decode (default: on for CUDA, off on CPU)")
    b.add_argument("--reps", type=positive_int, default=None,
                   help="timed repetitions per batch size (default 3 on a GPU, 1 on CPU)")
    b.add_argument("--warmup", type=nonneg_int, default=1,
                   help="untimed warm-up rounds per batch size (default 1)")
    b.add_argument("--max-seconds", type=positive_float, default=None,
                   help="soft time budget for the whole run (default 40 on CPU, none on "
                        "a GPU)")
    b.add_argument("--seed", type=nonneg_int, default=0, help="prompt RNG seed (default 0)")
    b.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N ranks, one process each, every one running "
                        "this command under a launcher (mpiexec -n N / torchrun "
                        "--nproc-per-node N); rank 0 reports, with each step's all-reduce "
                        "time and bytes (default 1)")
    b.add_argument("--json", type=json_out, metavar="FILE",
                   help="write the report as JSON to FILE (- for stdout; the table then goes "
                        "to stderr); an interrupted run writes the rows finished (on one "
                        "device: Ctrl-C aborts a tensor-parallel job)")
    b.add_argument("--compare-hf", action="store_true",
                   help="also run Hugging Face transformers on the same weights (needs torch "
                        "and transformers), interleaved with metrale's repetitions on the same "
                        "prompts, and report tokens/s ratios metrale/HF; on the CPU the "
                        "defaults become 2 repetitions and no time budget")
    b.add_argument("--hf-dtypes", type=hf_dtypes, default=None, metavar="float32,bfloat16",
                   help="HF model dtypes for --compare-hf (default float32,bfloat16)")
    b.add_argument("--plot", type=out_file, metavar="FILE.png",
                   help="plot tokens/s and roofline fraction against batch size (needs "
                        "matplotlib: pip install 'metrale[plot]')")
    b.set_defaults(func=run, resolve=resolve_model)


def json_out(text: str) -> str:
    return text if text == "-" else out_file(text)


def hf_dtypes(text: str) -> tuple[str, ...]:
    from ..bench.compare import parse_dtypes
    from ..errors import InvalidArgument
    try:
        return parse_dtypes(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_model(args) -> None:
    """Exactly one of MODEL, --model, --preset becomes `args.model`."""
    given = [x for x in (args.model, args.model_option,
                         None if args.preset is None else f"preset:{args.preset}") if x]
    if len(given) != 1:
        raise argparse.ArgumentTypeError("give the model once: metrale bench MODEL (a "
                                         "checkpoint directory, a .safetensors or .gguf file, "
                                         "or preset:NAME), --model MODEL or --preset NAME")
    args.model = model_spec(given[0])
    if args.hf_dtypes is not None and not args.compare_hf:
        raise argparse.ArgumentTypeError("--hf-dtypes is an option of --compare-hf")


def fit_lengths(prompt_len, gen_len, max_positions, model: str) -> tuple[int, int, str]:
    """(prompt_len, gen_len, note): the defaults shrunk to a model with few positions;
    InvalidArgument naming the flag to change when the lengths given cannot fit."""
    from ..errors import InvalidArgument
    room = None if max_positions is None else max_positions - SEQ_SLACK
    p = DEFAULT_PROMPT_LEN if prompt_len is None else prompt_len
    g = DEFAULT_GEN_LEN if gen_len is None else gen_len
    if room is None or p + g <= room:
        return p, g, ""
    if prompt_len is not None and gen_len is not None:
        raise InvalidArgument(f"--prompt-len {p} + --gen-len {g} (+{SEQ_SLACK}) exceed "
                              f"{model}'s max_position_embeddings {max_positions}: lower "
                              "--prompt-len or --gen-len")
    if prompt_len is not None:        # the user's prompt stays; the generation shrinks
        if p >= room:
            raise InvalidArgument(f"--prompt-len {p} leaves no room to generate in {model}'s "
                                  f"max_position_embeddings {max_positions}: lower "
                                  f"--prompt-len below {room}")
        g = room - p
    elif gen_len is not None:
        if g >= room:
            raise InvalidArgument(f"--gen-len {g} leaves no room for a prompt in {model}'s "
                                  f"max_position_embeddings {max_positions}: lower "
                                  f"--gen-len below {room}")
        p = room - g
    else:                              # both defaults: keep their 4:1 ratio
        p = max(1, room * DEFAULT_PROMPT_LEN // (DEFAULT_PROMPT_LEN + DEFAULT_GEN_LEN))
        g = max(1, room - p)
    return p, g, (f"bench: {model} has {max_positions} positions, so prompt {p} + gen {g} "
                  "tokens (set --prompt-len / --gen-len to choose)")


def run(args) -> int:
    from ..bench import BenchConfig, write_json
    if args.plot:
        from ..bench.plot import require_matplotlib
        require_matplotlib()  # fail before a long run, not after it
    peer = None
    if args.compare_hf:
        from ..bench.compare import HFComparison
        from ..bench.compare_hf import DTYPES, require_torch
        require_torch()       # before the model loads
        peer = HFComparison(args.hf_dtypes or DTYPES)
    model = args.model
    from ..errors import MetraleError
    from .checkpoint import open_checkpoint
    try:
        meta = open_checkpoint(model).metadata()
    except MetraleError as e:   # the other ranks of a tensor-parallel job raise it too
        if args.tensor_parallel > 1:
            from ..model_engine.tp.model import fail_rank
            fail_rank(e, args.tensor_parallel)
        raise
    # other architectures get the harness's own refusal
    from ..formats import DECODER_ARCHS
    positions = meta.max_position_embeddings if meta.architecture in DECODER_ARCHS or \
        meta.hybrid is not None else None
    prompt_len, gen_len, note = fit_lengths(args.prompt_len, args.gen_len, positions, model)
    if note:
        print(note, file=sys.stderr)
    cfg = BenchConfig(model=model, device=args.device, batches=tuple(args.batch),
                      prompt_len=prompt_len, gen_len=gen_len, cache=args.cache,
                      prefill=args.prefill,
                      graphs=None if args.graphs is None else args.graphs == "on",
                      reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds,
                      seed=args.seed, tensor_parallel=args.tensor_parallel,
                      extra={"command": "metrale " + shlex.join(args.argv)})
    # with --tensor-parallel every rank runs this; rank 0 reports for the group
    lead = args.tensor_parallel == 1 or _rank() == 0
    if not lead:
        with open(os.devnull, "w") as devnull:
            return 130 if run_rows(cfg, peer, devnull, quiet=True)[1] else 0
    report, interrupted = run_rows(cfg, peer, sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    elif args.json and report["results"]:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and report["results"]:
        from ..bench.plot import plot_report
        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if interrupted else 0


def _rank() -> int:
    from ..gpu_runtime.comm.ranks import launcher_ranks
    return launcher_ranks().rank


def run_rows(cfg, peer, out, quiet: bool = False) -> tuple[dict, bool]:
    """Run the bench printing the table to `out` a row at a time, as each batch size
    finishes, with a progress line on stderr when neither a progress bar nor the table is
    shown there (nor `quiet`: a tensor-parallel rank other than 0); on Ctrl-C, the rows
    finished. Returns (report, interrupted)."""
    from ..bench import BenchInterrupted, run_bench
    from ..bench.report import table_foot, table_head, table_row
    from .notes import Progress, note
    progress = None if quiet or sys.stderr.isatty() or out is sys.stderr else \
        Progress("bench", len(cfg.batches))

    def on_row(report, row):
        if len(report["results"]) == 1:
            print("\n".join(table_head(report)), file=out)
        print(table_row(row), file=out, flush=True)
        if progress is not None:
            progress.step(f"batch {row['batch']}: decode {row['decode_tokens_per_s']:,.1f} "
                          "tokens/s")
    from ..errors import OutOfMemory
    try:
        report, interrupted = run_bench(cfg, peer=peer, on_row=on_row), False
    except OutOfMemory as e:
        raise e.with_hint(
            "lower --batch, --prompt-len or --gen-len (the KV pool holds the largest batch's "
            "prompts and generations)" if e.fits_without_kv else
            "a quantized checkpoint (FP8, GPTQ or AWQ), or --tensor-parallel N under mpiexec "
            "over several devices, would") from None
    except BenchInterrupted as e:
        report, interrupted = e.report, True
        note(f"bench interrupted: {len(report['results'])} of {len(cfg.batches)} batch sizes "
             "finished" + ("; nothing to write" if not report["results"] else ""))
    if report["results"]:
        print("\n".join(table_foot(report)), file=out, flush=True)
    return report, interrupted
