"""`metrale` command line: bench | generate | ppl | embed | transcribe | info | check-kernels."""
from __future__ import annotations

import argparse
import json
import sys


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"metrale: error: {message}\n")


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="metrale", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ck = sub.add_parser("check-kernels", help="compile every kernels/*.cu with NVRTC (no GPU "
                        "needed) and report registers, spills and shared memory")
    ck.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    ck.add_argument("--arch", action="append", choices=["sm_80", "sm_90", "sm_90a"],
                    help="architecture (repeatable; default sm_80 and sm_90)")
    ck.set_defaults(func=_cmd_check_kernels)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "arch", None) is None and args.command == "check-kernels":
        args.arch = ["sm_80", "sm_90"]
    from .errors import MetraleError
    try:
        return int(args.func(args) or 0)
    except MetraleError as e:
        print(f"metrale: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
