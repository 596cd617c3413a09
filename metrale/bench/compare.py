"""`metrale bench --compare-hf`: HF repetitions interleaved with metrale's, medians, ratios.

`run_bench(cfg, peer=HFComparison(...))` calls `prepare` once after loading the model (HF
models built, logits check), then `after_rep` after every timed metrale repetition with the
prompts that repetition prefilled, and `section` at the end. Per batch size the order is
metrale rep, HF rep of each dtype (float32, then bfloat16), repeated `reps` times, all on the
same token ids. The HF side comes from `load_runners` (compare_hf.py); tests substitute a
function returning fake runners with the same `rep` / `last_logits` methods.
"""
from __future__ import annotations

from ..errors import InvalidArgument, Unsupported
from . import roofline
from .compare_hf import DECODE_MODE, DTYPES, PREFILL_MODE, logits_error, metrale_last_logits

LOGITS_TOLERANCE = 0.05   # max |metrale - HF| / max |HF| on the check prompt
CHECK_PROMPT_LEN = 64     # tokens of the logits-check prompt (or the prompt length if less)
WARM_LEN = 32             # tokens of each HF warm-up prefill (as the harness's warm-up)
WARM_STEPS = 2


def parse_dtypes(text: str) -> tuple[str, ...]:
    """"float32,bfloat16" -> ("float32", "bfloat16"); InvalidArgument on other names."""
    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    bad = [x for x in names if x not in DTYPES]
    if not names or bad or len(set(names)) != len(names):
        raise InvalidArgument(f"--hf-dtypes {text!r}: a comma-separated subset of "
                              f"{','.join(DTYPES)} without repeats")
    return names


class HFComparison:
    """The HF side of one bench run: runners per dtype, their timings per batch size."""

    def __init__(self, dtypes=DTYPES, load=None) -> None:
        self.dtypes = tuple(dtypes)
        if load is None:
            from .compare_hf import load_runners as load
        self._load = load
        self.runners: dict = {}
        self.facts: dict = {}
        self.logits_check: dict = {}
        self._reps: dict[int, dict[str, list[dict]]] = {}

    def prepare(self, model, source, device: str, prompt: list[int]) -> None:
        """Build the HF models and compare last-row logits of `prompt` with metrale's;
        Unsupported when any dtype is off by more than LOGITS_TOLERANCE."""
        self.runners, self.facts = self._load(source, device, self.dtypes)
        ours = metrale_last_logits(model, prompt)
        for name in self.dtypes:
            check = logits_error(ours, self.runners[name].last_logits(prompt))
            check["prompt_len"] = len(prompt)
            self.logits_check[name] = check
            print(f"bench --compare-hf: HF {name} logits vs metrale: relative max error "
                  f"{check['rel_max_err']:.2e} (argmax agree: {check['argmax_agree']})",
                  flush=True)
            if not check["rel_max_err"] <= LOGITS_TOLERANCE:
                raise Unsupported(f"{source.description}: HF {name} last-row logits differ "
                                  f"from metrale's by {check['rel_max_err']:.3g} (relative "
                                  f"max error > {LOGITS_TOLERANCE}): the two would not run "
                                  "the same model, so nothing was compared")

    def after_rep(self, batch: int, prompts: list[list[int]], steps: int) -> None:
        """One HF repetition per dtype on metrale's `prompts` ([B][P] ids), `steps` decode
        steps each; the first call per batch size also runs an untimed warm-up."""
        per = self._reps.get(batch)
        if per is None:
            per = self._reps[batch] = {name: [] for name in self.dtypes}
            warm = [p[:WARM_LEN] for p in prompts]
            for name in self.dtypes:
                self.runners[name].rep(warm, WARM_STEPS)
        for name in self.dtypes:
            per[name].append(self.runners[name].rep(prompts, steps))

    def section(self, results: list[dict], metrale_prefill: str = "each") -> dict:
        """The report's "hf" section: facts, logits check, and per batch size the HF
        medians and the ratios metrale / HF (above 1: metrale is faster). `metrale_prefill`:
        the bench's prefill setting ("batched" or "each")."""
        rows = []
        for r in results:
            B, P = r["batch"], r["prompt_len"]
            row = {"batch": B, "ratios": {}}
            for name in self.dtypes:
                reps = self._reps.get(B, {}).get(name, [])
                pre = [B * P / x["prefill_s"] for x in reps if x["prefill_s"] > 0]
                dec = [B * x["decode_steps"] / x["decode_s"] for x in reps if x["decode_s"] > 0]
                row[name] = {"prefill_tokens_per_s": roofline.median(pre),
                             "decode_tokens_per_s": roofline.median(dec),
                             "prefill_tokens_per_s_reps": pre,
                             "decode_tokens_per_s_reps": dec,
                             "decode_steps": [x["decode_steps"] for x in reps]}
                for key, short in (("prefill_tokens_per_s", "prefill"),
                                   ("decode_tokens_per_s", "decode")):
                    ours, theirs = r.get(key), row[name][key]
                    row["ratios"][f"{short}_vs_{name}"] = \
                        ours / theirs if ours and theirs else None
            rows.append(row)
        return {"attn_implementation": "sdpa", **self.facts, "dtypes": list(self.dtypes),
                "prefill_mode": PREFILL_MODE, "decode_mode": DECODE_MODE,
                "metrale_prefill_mode": METRALE_PREFILL_MODES[metrale_prefill],
                "order": "per batch size and repetition: metrale, then HF " +
                         ", ".join(self.dtypes) + "; same token ids; one untimed warm-up each",
                "logits_check": self.logits_check, "logits_tolerance": LOGITS_TOLERANCE,
                "results": rows}


METRALE_PREFILL_MODES = {
    "batched": "the B prompts in prefill_batch_chunk calls of as many prompts as one forward "
               "pass holds (max_prefill_tokens = min(B * prompt_len, 4096))",
    "each": "each sequence prefilled on its own",
}


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_hf_table(hf: dict) -> list[str]:
    """Lines for the end-of-run table: HF tokens/s per dtype and metrale / HF ratios."""
    errs = ", ".join(f"{k} {v['rel_max_err']:.1e}" for k, v in hf.get("logits_check", {}).items())
    lines = ["", f"HF transformers {hf.get('transformers')} (torch {hf.get('torch')}, "
                 f"{hf.get('torch_threads')} threads, {hf.get('attn_implementation')}) on the "
                 f"same weights; logits rel. error {errs or '-'}"]
    cols = [("batch", 5), ("HF dtype", 8), ("prefill tok/s", 13), ("decode tok/s", 12),
            ("metrale/HF prefill", 18), ("metrale/HF decode", 17)]
    lines.append("  ".join(f"{n:>{w}}" for n, w in cols))
    lines.append("  ".join("-" * w for _, w in cols))
    for row in hf.get("results", []):
        for name in hf.get("dtypes", []):
            d, q = row.get(name, {}), row.get("ratios", {})
            vals = [str(row["batch"]), name, _num(d.get("prefill_tokens_per_s"), ",.1f"),
                    _num(d.get("decode_tokens_per_s"), ",.1f"),
                    _num(q.get(f"prefill_vs_{name}"), ".2f"),
                    _num(q.get(f"decode_vs_{name}"), ".2f")]
            lines.append("  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    return lines
