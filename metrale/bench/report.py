"""Reading and writing benchmark reports: the `--json` schema and the table (its head, one
row per batch size as it finishes, and its foot)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import InvalidArgument

# The keys tests outside the project read (`metrale bench --json`). A row's "preset" is the
# NAME of preset:NAME (None for a checkpoint); "model" (top level and in each row) is
# preset:NAME or the checkpoint's path (model_labels).
TOP_KEYS = ("device", "gpu_name", "driver", "cupy", "cuda", "model", "results")
RESULT_KEYS = ("preset", "batch", "prompt_len", "gen_len", "prefill_tokens_per_s",
               "decode_tokens_per_s", "ttft_ms", "itl_ms_p50", "itl_ms_p99",
               "peak_memory_bytes", "hbm_gb_s", "roofline_fraction")
GPU_ONLY_RESULT_KEYS = ("hbm_gb_s", "roofline_fraction")


def model_labels(spec, source) -> tuple[str | None, str]:
    """(preset, model) a report records for the model `spec` (BenchConfig.model) opened as
    `source`: ("tiny", "preset:tiny") for a preset; (None, path) for a checkpoint directory,
    .safetensors or .gguf file, the path as `env.recorded_path` writes it (relative to the
    current directory when it is under it, no machine directories); (None, the source's
    description) for a source passed as an object."""
    from .env import recorded_path
    d = getattr(source, "description", str(source))
    if d.startswith("preset:"):
        return d[len("preset:"):], d
    if not isinstance(spec, (str, os.PathLike)):
        return None, d
    return None, recorded_path(Path(spec).resolve())


def check_schema(report: dict) -> None:
    """Raise InvalidArgument when `report` lacks a key of the documented schema."""
    missing = [k for k in TOP_KEYS if k not in report]
    if missing:
        raise InvalidArgument(f"bench report lacks {missing}")
    if not isinstance(report["results"], list):
        raise InvalidArgument("bench report: results must be a list")
    for i, r in enumerate(report["results"]):
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise InvalidArgument(f"bench report: results[{i}] lacks {missing}")


def write_json(report: dict, path) -> Path:
    """Write `report` to `path` atomically (a temporary file renamed over it)."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise InvalidArgument(f"--json {p}: directory {p.parent} does not exist")
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


COLUMNS = [("batch", 5), ("prefill tok/s", 13), ("decode tok/s", 12), ("TTFT ms", 9),
           ("ITL p50 ms", 10), ("ITL p99 ms", 10), ("peak MiB", 10), ("HBM GB/s", 9),
           ("roofline", 8)]


def format_table(report: dict) -> str:
    """A fixed-width table of the results, with a header naming model and device."""
    return "\n".join(table_head(report) + [table_row(r) for r in report.get("results", [])]
                     + table_foot(report))


def table_head(report: dict) -> list[str]:
    """The table's first lines: model, device and settings, then the column names."""
    dev = report.get("gpu_name") or report.get("device")
    cpu = report.get("cpu") or {}
    if not report.get("gpu_name") and cpu.get("model"):
        gemm = f", GEMM {cpu['gemm']}" if cpu.get("gemm") else ""
        dev = f"{dev} ({cpu['model']}, {cpu.get('cpus')} CPUs{gemm})"
    settings = report.get("settings", {})
    head = (f"model {report.get('model')}  device {dev}  cache {settings.get('cache', '-')}  "
            f"prefill {settings.get('prefill', '-')}")
    bw = report.get("copy_bandwidth_gb_s")
    if bw:
        head += f"  copy bandwidth {bw:,.0f} GB/s"
    return [head, "  ".join(f"{name:>{w}}" for name, w in COLUMNS),
            "  ".join("-" * w for _, w in COLUMNS)]


def table_row(r: dict) -> str:
    """One batch size's line of the table."""
    vals = [str(r["batch"]), _fmt(r["prefill_tokens_per_s"], ",.1f"),
            _fmt(r["decode_tokens_per_s"], ",.1f"), _fmt(r["ttft_ms"], ",.2f"),
            _fmt(r["itl_ms_p50"], ",.2f"), _fmt(r["itl_ms_p99"], ",.2f"),
            _mib(r["peak_memory_bytes"]), _fmt(r["hbm_gb_s"], ",.0f"),
            _fmt(r["roofline_fraction"], ".2f")]
    return "  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, COLUMNS))


def table_foot(report: dict) -> list[str]:
    """The lines after the rows: time-budget notes, the HF comparison, the settings."""
    lines = []
    notes = []
    tp = report.get("tensor_parallel", 1)
    if tp and tp > 1:
        notes.append(f"tensor parallel {tp}: {_mib(report.get('weight_bytes_per_rank'))} MiB "
                     "of weights per rank; per decode step, all-reduce time alone (and bytes "
                     "each rank receives): " + ", ".join(
                         f"batch {r['batch']}: {_fmt(r.get('allreduce_ms_per_step'), ',.3f')} ms"
                         f" ({_fmt((r.get('allreduce_bytes_per_step') or 0) / 1024, ',.1f')} KiB)"
                         for r in report.get("results", [])))
    for r in report.get("results", []):
        if r.get("decode_steps", r["gen_len"]) < r["gen_len"] or \
                r.get("prefill_seqs_timed", r["batch"]) < r["batch"]:
            notes.append(f"batch {r['batch']}: time budget: {r.get('prefill_seqs_timed')} of "
                         f"{r['batch']} prefills and {r.get('decode_steps')} of {r['gen_len']} "
                         "decode steps timed")
    if notes:
        lines += ["", *notes]
    if report.get("hf"):
        from .compare import format_hf_table
        lines += format_hf_table(report["hf"])
    s = report.get("settings", {})
    rss = report.get("peak_rss_bytes")
    lines.append(f"prompt {s.get('prompt_len')} tokens, {s.get('gen_len')} generated, "
                 f"{s.get('reps')} rep(s) after {s.get('warmup')} warm-up; medians; "
                 f"wall {report.get('wall_s', 0):.1f} s"
                 + (f"; peak RSS {_mib(rss)} MiB" if rss else ""))
    if report.get("interrupted"):
        done = len(report.get("results", []))
        lines.append(f"interrupted: {done} of {len(s.get('batches', []))} batch sizes finished")
    return lines
