"""`--plot FILE.png`: tokens/s and roofline fraction against batch size (matplotlib, the
optional extra `plot`)."""
from __future__ import annotations

from ..errors import Unsupported


def require_matplotlib():
    """Import matplotlib with a headless backend, or raise a clear Unsupported error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise Unsupported(f"--plot needs matplotlib ({e}); install it with "
                          "pip install 'metrale[plot]'") from None
    return plt


def plot_report(report: dict, path) -> None:
    """Two panels: prefill and decode tokens/s (log scale) and roofline fraction, by batch."""
    plt = require_matplotlib()
    rows = report["results"]
    batches = [r["batch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax1.plot(batches, [float("nan") if y is None else y for y in ys], "o-", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("tokens / s")
    ax1.set_title("throughput")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    fr = [r["roofline_fraction"] for r in rows]
    if any(f is not None for f in fr):
        ax2.plot(batches, [float("nan") if f is None else f for f in fr], "o-", color="C2")
        ax2.set_ylim(0, max(1.0, max(f for f in fr if f is not None) * 1.1))
        ax2.axhline(1.0, color="grey", ls="--", lw=0.8)
    else:
        ax2.text(0.5, 0.5, "roofline fraction needs a GPU", ha="center", va="center",
                 transform=ax2.transAxes)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("decode bytes / time / copy bandwidth")
    ax2.set_title("decode roofline fraction")
    ax2.grid(True, which="both", alpha=0.3)
    dev = report.get("gpu_name") or report.get("device")
    fig.suptitle(f"{report.get('model')} on {dev}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
