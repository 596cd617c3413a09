"""`metrale` command line: bench | generate | ppl | embed | transcribe | info | check-kernels.

`--model` takes a checkpoint directory (config.json + *.safetensors), a .safetensors file or
`preset:NAME` (random weights at a real model's shapes, no download). Bad arguments exit
with code 2 and one line on stderr; a failure metrale reports (MetraleError) exits with 1.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"metrale: error: {' '.join(str(message).split())}\n")


# argument types (a bad value is an argparse error: exit 2, one line) ---------------------
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def _positive_float(text: str) -> float:
    v = _nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def _top_p(text: str) -> float:
    v = _nonneg_float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return v


def _int_list(text: str, *, lo: int, hi: int | None = None, what: str) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of "
                                         f"{what}, e.g. 1,8,32")
    out = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{p!r} in {text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            where = f"{p!r}" if len(parts) == 1 else f"{p!r} in {text!r}"
            raise argparse.ArgumentTypeError(f"{where}: {what} must be {rng}")
        out.append(v)
    return tuple(out)


def _batch_list(text: str) -> tuple[int, ...]:
    return _int_list(text, lo=1, hi=1024, what="batch sizes")


def _token_ids(text: str) -> tuple[int, ...]:
    return _int_list(text, lo=0, what="token ids")


def _device(text: str) -> str:
    t = text.strip().lower()
    if t in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", t):
        return t
    raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, cuda or cuda:N")


def _preset_name(text: str) -> str:
    from .formats import PRESETS
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r} (known: "
                                         f"{', '.join(PRESETS)})")
    return text


def _model_spec(text: str) -> str:
    """A checkpoint directory, a .safetensors file or preset:NAME."""
    if text.startswith("preset:"):
        return "preset:" + _preset_name(text[len("preset:"):])
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    if p.is_file() and p.suffix != ".safetensors":
        raise argparse.ArgumentTypeError(f"{text}: expected a checkpoint directory, a "
                                         ".safetensors file or preset:NAME")
    return text


def _existing_file(text: str) -> str:
    p = Path(text)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def _out_file(text: str) -> str:
    p = Path(text)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    return text


# helpers ---------------------------------------------------------------------------------
def _load_tokenizer(source):
    """The checkpoint's tokenizer.json through the `tokenizers` package, or None when the
    checkpoint has none. Unsupported (exit 1) when it has one but the package is missing."""
    path = source.tokenizer_path()
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        from .errors import Unsupported
        raise Unsupported(f"{path}: reading it needs the tokenizers package; pip install "
                          "'metrale[tokenizers]' (or pass token ids with --ids)") from None
    return Tokenizer.from_file(str(path))


def _no_tokenizer(source, what: str):
    from .errors import InvalidArgument
    return InvalidArgument(f"{source.description} has no tokenizer.json, so {what} cannot be "
                           "tokenized; pass token ids with --ids 1,2,3")


def _open(spec: str):
    from .formats import open_source
    return open_source(spec)


def _load(source, device: str, **options):
    from .api import load
    return load(source, device, **options)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# commands --------------------------------------------------------------------------------
def _cmd_check_kernels(args) -> int:
    from .gpu_runtime import kernel_source
    try:
        records = kernel_source.check_all(tuple(args.arch))
    except ImportError as e:
        print(f"metrale: error: NVRTC bindings unavailable ({e}); pip install cuda-python "
              "nvidia-cuda-nvrtc-cu12", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            if not r["ok"]:
                print(f"{r['file']:<22} {r['arch']}  FAILED\n{r['error']}")
                continue
            for k in r["kernels"]:
                flag = "  SPILLS" if k["spill_stores"] or k["spill_loads"] else ""
                print(f"{r['file']:<22} {r['arch']}  {k['name']:<40} regs {k['registers']:>3}  "
                      f"spill {k['spill_stores']}/{k['spill_loads']} B  "
                      f"smem {k['shared_bytes']} B{flag}")
        n_bad = sum(not r["ok"] for r in records)
        print(f"{len(records)} compiles, {n_bad} failed")
    return 0 if all(r["ok"] for r in records) else 1


def _cmd_bench(args) -> int:
    from .bench import BenchConfig, format_table, run_bench, write_json
    if args.plot:
        from .bench.plot import require_matplotlib
        require_matplotlib()  # fail before a long run, not after it
    model = f"preset:{args.preset}" if args.preset else args.model
    cfg = BenchConfig(model=model, device=args.device, batches=tuple(args.batch),
                      prompt_len=args.prompt_len, gen_len=args.gen_len, cache=args.cache,
                      graphs=None if args.graphs is None else args.graphs == "on",
                      reps=args.reps, warmup=args.warmup, max_seconds=args.max_seconds,
                      seed=args.seed,
                      extra={"command": "metrale " + shlex.join(args.argv)})
    report = run_bench(cfg)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from .bench.plot import plot_report
        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _cmd_info(args) -> int:
    from .formats import num_parameters
    from .model_engine.memory_plan import weight_bytes
    source = _open(args.model)
    meta = source.metadata()
    n_params = int(num_parameters(meta))
    w = weight_bytes(meta)
    kv_tok = meta.num_layers * 2 * meta.num_kv_heads * meta.head_dim * 2
    kv = kv_tok * args.context * args.batch
    kv_and_ws = kv
    if meta.architecture in ("llama", "mistral", "qwen2", "qwen3"):
        # The decoder's own estimate: KV pool (+1 padding block) and every workspace.
        from .model_engine.workspace import Workspace
        bs = 16
        kv_and_ws = Workspace.estimate_bytes(
            meta, max_tokens=2048, max_rows=max(args.batch, 16),
            num_blocks=-(-args.context // bs) * args.batch, block_size=bs,
            max_blocks_per_seq=-(-args.context // bs), fp32_logits=False)
    info = {
        "model": source.description, "architecture": meta.architecture,
        "parameters": n_params, "dtype": meta.dtype, "device_dtype": "bfloat16",
        "layers": meta.num_layers, "hidden_size": meta.hidden_size,
        "intermediate_size": meta.intermediate_size, "heads": meta.num_heads,
        "kv_heads": meta.num_kv_heads, "head_dim": meta.head_dim,
        "vocab_size": meta.vocab_size, "max_position_embeddings": meta.max_position_embeddings,
        "tie_word_embeddings": meta.tie_word_embeddings,
        "weight_bytes": w, "kv_bytes_per_token": kv_tok,
        "context": args.context, "batch": args.batch,
        "memory_needed_bytes": w + kv_and_ws,
        "tokenizer": str(source.tokenizer_path()) if source.tokenizer_path() else None,
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"model          {info['model']}")
    print(f"architecture   {meta.architecture}")
    print(f"parameters     {n_params:,} ({n_params / 1e9:.2f} B)")
    print(f"dtype          {meta.dtype} in the checkpoint, bfloat16 on the device")
    print(f"shape          {meta.num_layers} layers, hidden {meta.hidden_size}, "
          f"intermediate {meta.intermediate_size}, {meta.num_heads} heads / "
          f"{meta.num_kv_heads} kv heads x {meta.head_dim}, vocab {meta.vocab_size}")
    print(f"context        up to {meta.max_position_embeddings:,} positions")
    print(f"weights        {_human_bytes(w)}")
    print(f"KV cache       {_human_bytes(kv_tok)} per token")
    print(f"memory needed  {_human_bytes(info['memory_needed_bytes'])} for batch {args.batch} "
          f"x {args.context:,} tokens (weights + KV cache + workspaces)")
    print(f"tokenizer      {info['tokenizer'] or 'none (use --ids)'}")
    return 0


def _sampling(args):
    from .engine import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed)


def _cmd_generate(args) -> int:
    from .engine import generate
    source = _open(args.model)
    tok = _load_tokenizer(source)
    if args.ids is not None:
        ids = list(args.ids)
    else:
        if tok is None:
            raise _no_tokenizer(source, "--prompt")
        ids = tok.encode(args.prompt).ids
    sampling = _sampling(args)
    model = _load(source, args.device)
    out: list[int] = []
    shown = [""]

    def on_token(t: int) -> None:
        out.append(int(t))
        if tok is None:
            sys.stdout.write(f"{t} ")
        else:
            text = tok.decode(out)
            if text.startswith(shown[0]):
                sys.stdout.write(text[len(shown[0]):])
                shown[0] = text
        sys.stdout.flush()

    try:
        res = generate(model, ids, args.max_new_tokens, sampling,
                       stop_token_ids=[] if args.ignore_eos else None, on_token=on_token)
    finally:
        model.teardown()
    sys.stdout.write("\n")
    print(f"{len(res.tokens)} tokens ({res.finish_reason}); TTFT {res.ttft_s * 1e3:.1f} ms; "
          f"decode {res.decode_tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0


def _ids_or_text(args, source, tok, what):
    if args.ids is not None:
        return list(args.ids)
    if tok is None:
        raise _no_tokenizer(source, what)
    return None


def _cmd_ppl(args) -> int:
    from .engine import perplexity
    source = _open(args.model)
    tok = _load_tokenizer(source) if args.ids is None else None
    ids = _ids_or_text(args, source, tok, "--text")
    if ids is None:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text).ids
    if len(ids) < 2:
        from .errors import InvalidArgument
        raise InvalidArgument(f"perplexity needs at least 2 tokens, got {len(ids)}")
    model = _load(source, args.device)
    try:
        ppl = perplexity(model, ids, window=args.window, stride=args.stride)
    finally:
        model.teardown()
    if args.json:
        print(json.dumps({"model": source.description, "tokens": len(ids), "perplexity": ppl}))
    else:
        print(f"perplexity {ppl:.4f} over {len(ids)} tokens")
    return 0


def _cmd_embed(args) -> int:
    import numpy as np
    from .engine import embed
    source = _open(args.model)
    if args.ids is not None:
        batch = [list(x) for x in args.ids]
        labels = [",".join(map(str, x)) for x in batch]
    else:
        tok = _load_tokenizer(source)
        if tok is None:
            raise _no_tokenizer(source, "--text")
        batch = [tok.encode(t).ids for t in args.text]
        labels = list(args.text)
    model = _load(source, args.device)
    try:
        vecs = embed(model, batch, pooling=args.pooling, normalize=not args.no_normalize)
    finally:
        model.teardown()
    if args.json:
        print(json.dumps([{"input": lab, "norm": float(np.linalg.norm(v)),
                           "vector": [float(x) for x in v]} for lab, v in zip(labels, vecs)]))
        return 0
    for lab, v in zip(labels, vecs):
        first = " ".join(f"{x:+.4f}" for x in v[:args.show])
        short = lab if len(lab) <= 40 else lab[:37] + "..."
        print(f"{short!r}: dim {v.shape[0]}, norm {float(np.linalg.norm(v)):.4f}, "
              f"first [{first}]")
    return 0


def _cmd_transcribe(args) -> int:
    from .errors import MetraleError, Unsupported
    try:
        from .audio import load_wav
        from .engine.transcribe import transcribe
    except ImportError as e:
        raise Unsupported(f"transcription is not available in this build ({e})") from None
    source = _open(args.model)
    tok = _load_tokenizer(source)
    try:
        audio = load_wav(args.file)
    except MetraleError:
        raise
    except Exception as e:  # wave.Error, EOFError, ValueError...: a bad file, one line
        from .errors import FormatError
        raise FormatError(f"{args.file}: cannot read as WAV audio ({type(e).__name__}: "
                          f"{e})") from None
    model = _load(source, args.device)
    try:
        result = transcribe(model, audio, tokenizer=tok)
    finally:
        teardown = getattr(model, "teardown", None)
        if teardown is not None:
            teardown()
    text = result if isinstance(result, str) else getattr(result, "text", None)
    if args.json:
        tokens = getattr(result, "tokens", None)
        print(json.dumps({"file": args.file, "text": text,
                          "tokens": list(tokens) if tokens is not None else None}))
    elif text is not None:
        print(text)
    else:
        tokens = getattr(result, "tokens", result)
        print(" ".join(str(t) for t in tokens))
    return 0


# parser ----------------------------------------------------------------------------------
def _add_device(p) -> None:
    p.add_argument("--device", type=_device, default="auto",
                   help="auto (CUDA when CuPy sees a GPU, else CPU), cpu, cuda or cuda:N "
                        "(default auto; env METRALE_DEVICE)")


def _add_model(p) -> None:
    p.add_argument("--model", type=_model_spec, required=True, metavar="DIR",
                   help="checkpoint directory, .safetensors file or preset:NAME")


def _add_ids(p, help_text: str) -> None:
    p.add_argument("--ids", type=_token_ids, metavar="1,2,3", help=help_text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="metrale", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser,
                           metavar="COMMAND")

    b = sub.add_parser("bench", help="throughput, latency, memory and roofline per batch size",
                       description="Prefill and decode benchmark per batch size: prefill and "
                       "decode tokens/s, TTFT, inter-token latency p50/p99, peak memory, and on "
                       "a GPU the achieved HBM GB/s and roofline fraction (decode bytes / step "
                       "time / measured copy bandwidth). Presets are random weights at real "
                       "shapes. On the CPU a time budget (--max-seconds, default 40) keeps the "
                       "defaults under a minute.")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=_model_spec, metavar="DIR",
                     help="checkpoint directory, .safetensors file or preset:NAME")
    src.add_argument("--preset", type=_preset_name, metavar="NAME",
                     help="random weights at a preset's shapes (tiny, llama-3.1-8b, ...)")
    _add_device(b)
    b.add_argument("--batch", type=_batch_list, default=(1, 8, 32, 64), metavar="1,8,32,64",
                   help="batch sizes, comma-separated (default 1,8,32,64)")
    b.add_argument("--prompt-len", type=_positive_int, default=512,
                   help="prompt tokens per sequence (default 512)")
    b.add_argument("--gen-len", type=_positive_int, default=128,
                   help="decode steps (default 128)")
    b.add_argument("--cache", choices=["paged", "contiguous"], default="paged",
                   help="KV cache: the paged pool or the contiguous baseline (default paged)")
    b.add_argument("--graphs", choices=["on", "off"], default=None,
                   help="CUDA graphs for decode (default: on for CUDA, off on CPU)")
    b.add_argument("--reps", type=_positive_int, default=None,
                   help="timed repetitions per batch size (default 3 on a GPU, 1 on CPU)")
    b.add_argument("--warmup", type=_nonneg_int, default=1,
                   help="untimed warm-up rounds per batch size (default 1)")
    b.add_argument("--max-seconds", type=_positive_float, default=None,
                   help="soft time budget for the whole run (default 40 on CPU, none on "
                        "a GPU)")
    b.add_argument("--seed", type=_nonneg_int, default=0, help="prompt RNG seed (default 0)")
    b.add_argument("--json", type=_out_file, metavar="FILE", help="write the report as JSON")
    b.add_argument("--plot", type=_out_file, metavar="FILE.png",
                   help="plot tokens/s and roofline fraction against batch size (needs "
                        "matplotlib: pip install 'metrale[plot]')")
    b.set_defaults(func=_cmd_bench)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming tokens",
                       description="Generate after a prompt (tokenized with the checkpoint's "
                       "tokenizer.json; needs the tokenizers package) or after token ids; "
                       "prints tokens as they come.")
    _add_model(g)
    ing = g.add_mutually_exclusive_group(required=True)
    ing.add_argument("--prompt", metavar="TEXT", help="prompt text")
    _add_ids(ing, "prompt token ids, when the checkpoint has no tokenizer")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64,
                   help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=_nonneg_float, default=0.0,
                   help="0 is greedy (default 0)")
    g.add_argument("--top-k", type=_nonneg_int, default=0, help="0 keeps every token")
    g.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--seed", type=_nonneg_int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's eos ids")
    _add_device(g)
    g.set_defaults(func=_cmd_generate)

    pp = sub.add_parser("ppl", help="perplexity of a text file",
                        description="Perplexity of a text file (tokenized with the "
                        "checkpoint's tokenizer.json) or of token ids, with a sliding window.")
    _add_model(pp)
    inp = pp.add_mutually_exclusive_group(required=True)
    inp.add_argument("--text", type=_existing_file, metavar="FILE", help="UTF-8 text file")
    _add_ids(inp, "token ids, when the checkpoint has no tokenizer")
    pp.add_argument("--window", type=_positive_int, default=None,
                    help="tokens per forward context (default: the whole text or max_seq_len)")
    pp.add_argument("--stride", type=_positive_int, default=None,
                    help="window step (default: the window)")
    pp.add_argument("--json", action="store_true", help="print JSON")
    _add_device(pp)
    pp.set_defaults(func=_cmd_ppl)

    e = sub.add_parser("embed", help="embedding vectors of texts",
                       description="Embeddings from the final-norm hidden states: prints each "
                       "vector's norm and first values, or JSON.")
    _add_model(e)
    ine = e.add_mutually_exclusive_group(required=True)
    ine.add_argument("--text", action="append", metavar="TEXT",
                     help="text to embed (repeatable)")
    ine.add_argument("--ids", type=_token_ids, action="append", metavar="1,2,3",
                     help="token ids to embed (repeatable), when there is no tokenizer")
    e.add_argument("--pooling", choices=["last", "mean"], default="last",
                   help="last position (default) or mean over positions")
    e.add_argument("--no-normalize", action="store_true", help="keep the raw vector norm")
    e.add_argument("--show", type=_nonneg_int, default=8, help="values to print (default 8)")
    e.add_argument("--json", action="store_true", help="print the vectors as JSON")
    _add_device(e)
    e.set_defaults(func=_cmd_embed)

    t = sub.add_parser("transcribe", help="speech to text with a Whisper checkpoint",
                       description="Transcribe a .wav file with a Whisper checkpoint.")
    t.add_argument("file", type=_existing_file, metavar="FILE.wav", help="audio file")
    _add_model(t)
    t.add_argument("--json", action="store_true", help="print JSON")
    _add_device(t)
    t.set_defaults(func=_cmd_transcribe)

    i = sub.add_parser("info", help="architecture, parameters, dtype and memory of a checkpoint",
                       description="Architecture, parameter count, dtype and the device memory "
                       "a checkpoint needs (weights + KV cache + workspaces).")
    i.add_argument("model", type=_model_spec, metavar="DIR",
                   help="checkpoint directory, .safetensors file or preset:NAME")
    i.add_argument("--context", type=_positive_int, default=4096,
                   help="tokens per sequence for the memory estimate (default 4096)")
    i.add_argument("--batch", type=_positive_int, default=1,
                   help="sequences for the memory estimate (default 1)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_cmd_info)

    ck = sub.add_parser("check-kernels", help="compile every kernels/*.cu with NVRTC (no GPU "
                        "needed) and report registers, spills and shared memory")
    ck.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    ck.add_argument("--arch", action="append", choices=["sm_80", "sm_90", "sm_90a"],
                    help="architecture (repeatable; default sm_80 and sm_90)")
    ck.set_defaults(func=_cmd_check_kernels)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # bad arguments (2) or --help (0), as a return code
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    args.argv = argv
    if getattr(args, "arch", None) is None and args.command == "check-kernels":
        args.arch = ["sm_80", "sm_90"]
    from .errors import MetraleError
    try:
        return int(args.func(args) or 0)
    except MetraleError as e:
        print(f"metrale: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("metrale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
