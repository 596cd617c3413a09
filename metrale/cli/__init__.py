"""`metrale` command line: bench | generate | ppl | embed | transcribe | info | check-kernels.

`--model` takes a checkpoint directory (config.json + *.safetensors), a .safetensors file or
`preset:NAME` (random weights at a real model's shapes, no download). Bad arguments exit
with code 2 and one line on stderr; a failure metrale reports (MetraleError) exits with 1.
"""
from __future__ import annotations

import argparse
import sys

from . import bench, check_kernels, embed, generate, info, ppl, transcribe
from .args import Parser

# In the order `metrale --help` lists them.
SUBCOMMANDS = (bench, generate, ppl, embed, transcribe, info, check_kernels)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="metrale", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser,
                           metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.register(sub)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # bad arguments (2) or --help (0), as a return code
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    args.argv = argv
    from ..errors import MetraleError
    try:
        return int(args.func(args) or 0)
    except MetraleError as e:
        print(f"metrale: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("metrale: interrupted", file=sys.stderr)
        return 130
