"""Argument types and shared options of every `metrale` subcommand.

A bad value raises `argparse.ArgumentTypeError`, which `Parser` turns into one line on
stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"metrale: error: {' '.join(str(message).split())}\n")


# numbers ---------------------------------------------------------------------------------
def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= {lo}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def positive_float(text: str) -> float:
    v = nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def top_p(text: str) -> float:
    v = nonneg_float(text)
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


def batch_list(text: str) -> tuple[int, ...]:
    return _int_list(text, lo=1, hi=1024, what="batch sizes")


def token_ids(text: str) -> tuple[int, ...]:
    return _int_list(text, lo=0, what="token ids")


# names and paths -------------------------------------------------------------------------
def device(text: str) -> str:
    t = text.strip().lower()
    if t in ("auto", "cpu", "emu") or re.fullmatch(r"cuda(:\d+)?", t):
        return t
    raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, emu, cuda or cuda:N")


def preset_name(text: str) -> str:
    from ..formats import PRESETS
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r} (known: "
                                         f"{', '.join(PRESETS)}; metrale info --presets "
                                         "describes them)")
    return text


def model_spec(text: str) -> str:
    """A checkpoint directory, a .safetensors or .gguf file, or preset:NAME."""
    if text.startswith("preset:"):
        return "preset:" + preset_name(text[len("preset:"):])
    p = Path(text)
    if not p.exists():
        from ..formats.hub import hub_hint
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory{hub_hint(text)}")
    if p.is_file() and p.suffix not in (".safetensors", ".gguf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a checkpoint directory, a "
                                         ".safetensors or .gguf file, or preset:NAME")
    return text


def existing_file(text: str) -> str:
    p = Path(text)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def out_file(text: str) -> str:
    p = Path(text)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    return text


def utf8_text(text: str, what: str = "the text") -> str:
    """`text` from the command line, checked to be UTF-8: Python hands over bytes that do not
    decode (a shell in another locale, a Latin-1 file pasted with $(cat ...)) as lone
    surrogates, which no tokenizer takes. ArgumentTypeError naming `what` and the byte
    offset, as `ppl --text` does for a file."""
    raw = text.encode("utf-8", "surrogateescape")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.start + 4].hex(" ")
        raise argparse.ArgumentTypeError(
            f"{what} is not valid UTF-8 at byte offset {e.start} (bytes {bad}: {e.reason}); "
            "convert it to UTF-8 or pass token ids with --ids") from None
    except UnicodeEncodeError:   # a surrogate that did not come from a byte: not text
        raise argparse.ArgumentTypeError(f"{what} holds unpaired surrogates") from None
    return text


def utf8_option(what: str):
    """An argparse type: `utf8_text` for option `what`."""
    def parse(text: str) -> str:
        return utf8_text(text, what)
    parse.__name__ = what
    return parse


# options several subcommands share -------------------------------------------------------
def add_device(p) -> None:
    p.add_argument("--device", type=device, default="auto",
                   help="auto (CUDA when CuPy sees a GPU, else CPU), cpu, cuda, cuda:N or "
                        "emu (the CUDA kernels' own sources compiled for and run on the CPU, "
                        "slow; a check without a GPU) (default auto; env METRALE_DEVICE)")


MODEL_HELP = "checkpoint directory (config.json + *.safetensors), .safetensors file, " \
    "llama.cpp .gguf file or preset:NAME"


def add_model(p) -> None:
    """MODEL as the first positional argument, with `--model MODEL` kept as an alias;
    `resolve_model` (run by `metrale.cli.main` after parsing) checks that exactly one was
    given and validates it."""
    p.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--model", dest="model_option", metavar="MODEL",
                   help="the same as the positional MODEL")
    p.set_defaults(resolve=resolve_model)


def resolve_model(args) -> None:
    """Merge the positional MODEL and --model into `args.model` (validated)."""
    if args.model is not None and args.model_option is not None:
        raise argparse.ArgumentTypeError("give the model once: as the first argument MODEL "
                                         "or as --model MODEL, not both")
    spec = args.model if args.model is not None else args.model_option
    if spec is None:
        raise argparse.ArgumentTypeError("the model is required: metrale "
                                         f"{args.command} MODEL ... (a checkpoint directory, "
                                         "a .safetensors or .gguf file, or preset:NAME)")
    args.model = model_spec(spec)


def add_max_seq_len(p) -> None:
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="context limit in tokens (load option max_seq_len; default: the "
                        "checkpoint's max_position_embeddings, within the KV pool)")


def add_ids(p, help_text: str) -> None:
    p.add_argument("--ids", type=token_ids, metavar="1,2,3", help=help_text)
