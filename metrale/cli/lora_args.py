"""The LoRA options of `metrale generate` and `metrale info`:

  --lora NAME=DIR       a PEFT adapter directory, repeatable (the load option loras)
  --adapter NAME        generate: the adapter the prompt runs (one of the --lora names)
  --max-loras N, --max-lora-rank R
                        info: the slots to size (default: one per --lora, the largest rank)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .args import positive_int


def lora_spec(text: str) -> tuple[str, str]:
    """NAME=DIR, DIR an existing directory."""
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR (a PEFT adapter "
                                         "directory under a name)")
    if not Path(directory).is_dir():
        raise argparse.ArgumentTypeError(f"{directory}: no such directory")
    return name, directory


def add_lora(p, *, generate: bool) -> None:
    p.add_argument("--lora", action="append", type=lora_spec, metavar="NAME=PATH",
                   help="a PEFT LoRA adapter (adapter_config.json + "
                        "adapter_model.safetensors) loaded into a slot under NAME; repeatable")
    if generate:
        p.add_argument("--adapter", metavar="NAME",
                       help="generate with the --lora adapter NAME (default: the base model)")
    else:
        p.add_argument("--max-loras", type=positive_int, default=None, metavar="N",
                       help="LoRA slots to size (default: one per --lora)")
        p.add_argument("--max-lora-rank", type=positive_int, default=None, metavar="R",
                       help="their rank (default: the largest rank of the --lora adapters, "
                            "else 16)")


def lora_load_options(args) -> dict:
    """The load options of the flags ({} without any), checked: names distinct, --adapter
    one of them."""
    pairs = args.lora or []
    names = [n for n, _ in pairs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise argparse.ArgumentTypeError(f"--lora: the name {sorted(dup)[0]!r} is given twice")
    adapter = getattr(args, "adapter", None)
    if adapter is not None and adapter not in names:
        raise argparse.ArgumentTypeError(
            f"--adapter {adapter}: no --lora {adapter}=DIR was given"
            + (f" (given: {', '.join(names)})" if names else ""))
    opts = {"loras": dict(pairs)} if pairs else {}
    if getattr(args, "max_loras", None) is not None:
        opts["max_loras"] = args.max_loras
    if getattr(args, "max_lora_rank", None) is not None:
        opts["max_lora_rank"] = args.max_lora_rank
    return opts
