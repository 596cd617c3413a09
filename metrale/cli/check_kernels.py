"""`metrale check-kernels`: compile every kernels/*.cu with NVRTC (no GPU needed) and report
registers, spills and shared memory per kernel."""
from __future__ import annotations

import json
import sys

DEFAULT_ARCHS = ("sm_80", "sm_90")


def register(sub) -> None:
    ck = sub.add_parser("check-kernels", help="compile every kernels/*.cu with NVRTC (no GPU "
                        "needed) and report registers, spills and shared memory",
                        description="Compile every CUDA kernel metrale ships (kernels/*.cu, "
                        "found inside the installed package) with NVRTC for each "
                        "architecture, without a GPU, and report per kernel its registers, "
                        "spill stores/loads and static shared memory, as ptxas -v prints "
                        "them. A file fails when it does not compile, when an entry point "
                        "of its source is missing from what ptxas compiled, or when inline "
                        "asm has no C++ fallback. Exit status 1 when any compile fails. A "
                        "progress line per compile goes to stderr; the table or the JSON "
                        "(--json) to stdout.")
    ck.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    ck.add_argument("--arch", action="append", choices=["sm_80", "sm_90", "sm_90a"],
                    help="architecture (repeatable; default sm_80 and sm_90)")
    ck.add_argument("--profile", action="store_true",
                    help="count every kernel of a decode and a prefill step of a real model "
                    "preset on the EmuBackend and print an ESTIMATE of their time on H100/"
                    "H200 (minutes of CPU; see metrale/bench/emu_profile.py)")
    ck.add_argument("--preset", action="append",
                    help="with --profile: model preset (repeatable; default llama-3.1-8b "
                    "and qwen2.5-7b)")
    ck.add_argument("--profile-json", metavar="FILE",
                    help="with --profile: also write the report as JSON to FILE")
    ck.set_defaults(func=run)


def run_profile(args) -> int:
    from pathlib import Path

    from ..bench import emu_profile as profile
    from .notes import Progress
    presets = args.preset or ["llama-3.1-8b", "qwen2.5-7b"]
    # a line per NVRTC compile and per phase of each preset (minutes in all)
    progress = Progress("check-kernels --profile", None)
    figures = profile.nvrtc_figures(progress.step)
    rep = profile.report([profile.profile_preset(p, figures=figures, on_progress=progress.step)
                          for p in presets])
    rep["command"] = "metrale check-kernels --profile" + "".join(f" --preset {p}"
                                                                 for p in args.preset or [])
    rep["nvrtc_figures"] = bool(figures)
    print(json.dumps(rep, indent=1) if args.json else profile.format_report(rep))
    if args.profile_json:
        Path(args.profile_json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


def run(args) -> int:
    if getattr(args, "profile", False):
        return run_profile(args)
    from ..gpu_runtime import kernel_source
    from .notes import Progress
    archs = tuple(args.arch) if args.arch else DEFAULT_ARCHS
    progress = None

    def on_record(rec, i, total):
        nonlocal progress
        progress = progress or Progress("check-kernels", total)
        progress.step(f"{rec['file']} {rec['arch']}{'' if rec['ok'] else ' FAILED'}")
    try:
        records = kernel_source.check_all(archs, on_record=on_record)
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
