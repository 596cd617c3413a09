"""`metrale` command line: bench | generate | ppl | embed | transcribe | info | check-kernels.

Every command that runs a model takes it as its first argument MODEL (`--model MODEL` is
the same): a local checkpoint directory (config.json + *.safetensors), a .safetensors file,
a llama.cpp .gguf file or `preset:NAME` (random weights at a real model's shapes, no
download; `metrale info --presets` lists them). Bad arguments exit
with code 2 and one line on stderr; a failure metrale reports (MetraleError) exits with 1;
output piped into a reader that stops early (`| head`) ends quietly with 141 (as SIGPIPE).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def subcommands() -> list:
    """The subcommand modules, in the order `metrale --help` lists them. Imported here,
    inside `main`, where an interrupt is caught like any other: a Ctrl-C while the command
    line starts ends with one line, not a traceback."""
    from . import bench, check_kernels, embed, generate, info, ppl, transcribe
    return [bench, generate, ppl, embed, transcribe, info, check_kernels]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from .args import Parser
    p = Parser(prog="metrale", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-V", "--version", action="version", version=f"metrale {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser,
                           metavar="COMMAND")
    for command in subcommands():
        command.register(sub)
    return p


def main(argv=None) -> int:
    """The `metrale` command: exit status 0, 1 (a MetraleError, one line), 2 (bad
    arguments), 130 (interrupted, one line) or 141 (stdout closed)."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt as e:
        detail = str(e)
        with _sigint_ignored():   # a second Ctrl-C while the line is written adds nothing
            print(f"metrale: interrupted{' ' + detail if detail else ''}", file=sys.stderr)
        return 130


class _sigint_ignored:
    """SIGINT ignored inside the block, then the previous handler back (main thread only:
    elsewhere Python delivers no signals)."""

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:   # not the main thread
            self._old = None

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _run(argv: list) -> int:
    parser = build_parser()
    if not argv:   # `metrale` alone: the help, as `metrale --help` prints it
        parser.print_help()
        return 0
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as e:  # bad arguments (2) or --help (0), as a return code
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    args.argv = argv
    # argparse gives a positional that follows an option to nobody (`generate MODEL --chat
    # "text"`): commands whose last positional takes more (PROMPT, AUDIO files) get them.
    unknown = [x for x in extras if x.startswith("-") and x != "-"]
    if unknown or (extras and not getattr(args, "takes_more_positionals", False)):
        print(f"metrale: error: unrecognized arguments: {' '.join(unknown or extras)}",
              file=sys.stderr)
        return 2
    args.more_positionals = list(extras)
    resolve = getattr(args, "resolve", None)
    if resolve is not None:
        try:
            resolve(args)
        except argparse.ArgumentTypeError as e:
            print(f"metrale: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    from ..errors import MetraleError
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's last flush
        return rc
    except MetraleError as e:
        # one write with its newline: the ranks of a tensor-parallel job share the
        # launcher's stderr, and print's two writes let another rank's line in between
        sys.stderr.write(f"metrale: error: {' '.join(str(e).split())}\n")
        sys.stderr.flush()
        return 1
    except KeyboardInterrupt:   # a tensor-parallel job ends as a whole (N > 1: no return)
        from ..gpu_runtime.comm.interrupts import end_interrupted_job
        end_interrupted_job(getattr(args, "tensor_parallel", 1))
        raise                       # main's one line
    except BrokenPipeError:
        return _closed_pipe()


# 128 + SIGPIPE: what a command killed by the closed pipe reports in a shell
CLOSED_PIPE_STATUS = 141


def _closed_pipe() -> int:
    """The reader of stdout went away: stop quietly. stdout is pointed at /dev/null so the
    interpreter's final flush of what is still buffered cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # stdout is not a real file (captured in tests)
        pass
    return CLOSED_PIPE_STATUS
