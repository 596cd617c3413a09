"""`run_bench`: prefill and decode throughput, latency and memory per batch size.

For each batch size B, after `warmup` untimed rounds (which compile kernels and capture the
decode graph of B's padded size), `reps` repetitions of:

1. open B sequences (paged: from the model's pool; contiguous: one dense `KVCache` arena
   for all B rows), each with its own random prompt of `prompt_len` tokens, and prefill
   them up to their first tokens (device argmax, which synchronizes). `prefill="batched"`
   (the default, as a serving engine and HF's batched forward do): paged sequences go
   through `prefill_batch_chunk` in groups of as many prompts as one forward pass holds
   (`max_prefill_tokens`, which the bench sizes to min(B * prompt_len, 4096)), and the
   first group's time is the TTFT; `prefill="each"` (and the contiguous cache): one
   `prefill` per sequence, the first one's time is the TTFT. Prefill tokens/s = timed
   tokens / their total time.
2. `gen_len` steps of `decode_batch` over all B rows, each followed by the device argmax of
   every row (the greedy next tokens, a synchronizing copy); the wall time of each step is
   one inter-token latency. decode tokens/s = B * steps / total decode time.

Throughputs, TTFT and bandwidth are medians over repetitions; ITL percentiles pool every
step of every repetition. Peak memory is `backend.peak_bytes()` after `reset_peak()` at
the start of the batch size (it includes the weights and the preallocated pool).

On a GPU, `hbm_gb_s` = bytes the decode steps had to read (`roofline.decode_step_bytes`) /
their time, and `roofline_fraction` = that / the device copy bandwidth measured in the same
run. Both are None on the host backend.

Tensor parallelism (`tensor_parallel` N > 1): bench/tensor_parallel.py.

Time budget (`max_seconds`, default 40 s on the CPU, none on a GPU): the CPU twins are slow,
so when a batch size's share of the budget runs out the remaining prompts of that batch are
copies of the first prefilled sequence (`fork_sequence`, or a copy of its dense cache rows)
instead of fresh prefills, and decode stops after the steps done so far (at least 2). The
result rows say how many sequences and steps were timed (`prefill_seqs_timed`,
`decode_steps`).

With a `peer` (`compare.HFComparison`, `metrale bench --compare-hf`), Hugging Face
transformers runs on the same weights: after each timed metrale repetition the peer times one
repetition per HF dtype on the same prompts and step count. There the CPU defaults are 2
repetitions and no time budget. `peak_rss_bytes` is the process's peak resident set.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InvalidArgument
from . import roofline, tensor_parallel
from .env import environment, peak_rss_bytes
from .report import model_labels
from .rows import Rows

CPU_DEFAULT_SECONDS = 40.0
_MIN_DECODE_STEPS = 2


@dataclass
class BenchConfig:
    model: str = "preset:tiny"          # "preset:NAME", a checkpoint directory or a source
    device: str = "auto"
    batches: tuple = (1, 8, 32, 64)
    prompt_len: int = 512
    gen_len: int = 128
    cache: str = "paged"                # "paged" | "contiguous"
    prefill: str = "batched"            # "batched" (prefill_batch_chunk groups) | "each"
    graphs: bool | None = None          # None: the model's default (on for CUDA)
    reps: int | None = None             # None: 3 on a GPU, 1 on the CPU
    warmup: int = 1
    max_seconds: float | None = None    # None: 40 s on the CPU, unlimited on a GPU
    seed: int = 0
    progress: bool | None = None        # None: a bar when stderr is a terminal
    tensor_parallel: int = 1            # ranks (one process each, started by a launcher)
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        if not self.batches or any(isinstance(b, bool) or not isinstance(b, int) or
                                   not 1 <= b <= 1024 for b in self.batches):
            raise InvalidArgument(f"batch sizes must be ints in [1, 1024], got {self.batches!r}")
        for name in ("prompt_len", "gen_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {v!r}")
        if self.cache not in ("paged", "contiguous"):
            raise InvalidArgument(f"cache must be 'paged' or 'contiguous', got {self.cache!r}")
        if self.prefill not in ("batched", "each"):
            raise InvalidArgument(f"prefill must be 'batched' or 'each', got {self.prefill!r}")
        if self.reps is not None and (not isinstance(self.reps, int) or self.reps < 1):
            raise InvalidArgument(f"reps must be an int >= 1, got {self.reps!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise InvalidArgument(f"warmup must be an int >= 0, got {self.warmup!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise InvalidArgument(f"max_seconds must be > 0, got {self.max_seconds!r}")
        tensor_parallel.check(self.tensor_parallel, self.max_seconds)


class BenchInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt during `run_bench`, with `.report`: the rows finished before it."""

    def __init__(self, report: dict) -> None:
        super().__init__("bench interrupted")
        self.report = report


def _progress(enabled, total, desc):
    if enabled is None:
        enabled = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, file=sys.stderr,
                leave=False, dynamic_ncols=True)


def run_bench(cfg: BenchConfig, backend=None, peer=None, on_row=None) -> dict:
    """Run the benchmark described by `cfg`; returns the JSON-ready report dict. `peer`:
    an `HFComparison` timed between metrale's repetitions (its results go under "hf").
    `on_row(report, row)` is called as each batch size's row is done (`report` holds the
    rows so far). Ctrl-C raises `BenchInterrupted` carrying the report of the rows
    finished (`"interrupted": true`, no "hf" section)."""
    cfg.check()
    from ..formats import DECODER_ARCHS, num_parameters, open_source
    from ..formats.moe_config import inactive_parameters
    t_start = time.perf_counter()
    tp = cfg.tensor_parallel
    tensor_parallel.check(tp, cfg.max_seconds, peer)
    be = backend if backend is not None else tensor_parallel.rank_backend(cfg.device, tp)
    on_gpu = roofline.is_device(be)
    reps = cfg.reps if cfg.reps is not None else (3 if on_gpu else 1 if peer is None else 2)
    budget = cfg.max_seconds if cfg.max_seconds is not None else \
        (None if on_gpu or peer is not None or tp > 1 else CPU_DEFAULT_SECONDS)
    source = open_source(cfg.model)
    meta = source.metadata()
    if meta.architecture not in DECODER_ARCHS and meta.hybrid is None:
        raise InvalidArgument(f"{source.description}: bench runs decoder-only models, not "
                              f"{meta.architecture!r}")
    warm_len = min(cfg.prompt_len, 32)
    seq_cap = cfg.prompt_len + cfg.gen_len + 2
    if seq_cap > meta.max_position_embeddings:
        raise InvalidArgument(f"prompt_len + gen_len = {cfg.prompt_len + cfg.gen_len} exceeds "
                              f"the model's max_position_embeddings "
                              f"{meta.max_position_embeddings}")
    block_size = 16
    per_seq = -(-seq_cap // block_size) + 1
    bmax = max(cfg.batches)
    kv_blocks = bmax * per_seq + 8 if cfg.cache == "paged" else per_seq + 8
    # batched prefill needs the paged cache (the contiguous baseline's sequences live outside
    # the model's pool); one forward pass holds `group` whole prompts, or one
    prefill_mode = "batched" if cfg.prefill == "batched" and cfg.cache == "paged" else "each"
    max_prefill = min(max(cfg.prompt_len * (bmax if prefill_mode == "batched" else 1), 16),
                      4096)
    group = max(1, max_prefill // cfg.prompt_len) if prefill_mode == "batched" else 1
    env = environment(be)
    copy_gb_s = roofline.copy_bandwidth(be)
    t0 = time.perf_counter()
    model = tensor_parallel.load_model(be, source, tp, kv_blocks=kv_blocks,
                                       block_size=block_size, max_batch=bmax,
                                       max_prefill_tokens=max_prefill,
                                       max_seq_len=per_seq * block_size, graphs=cfg.graphs,
                                       progress=bool(cfg.progress) if cfg.progress is not None
                                       else sys.stderr.isatty())
    load_s = time.perf_counter() - t0
    try:
        _check_finite_logits(model, warm_len, np.random.default_rng([cfg.seed, 0]))
    except BaseException:
        model.teardown()
        raise
    weights_per_rank = int(model._weights.nbytes)
    results = []
    label = model_labels(cfg.model, source)   # (preset NAME or None, model path)
    report = dict(env)
    report.update({
        "model": label[1],
        "results": results,
        "architecture": meta.architecture,
        "parameters": int(num_parameters(meta)),
        "active_parameters": int(num_parameters(meta) - inactive_parameters(meta, 1)),
        "copy_bandwidth_gb_s": copy_gb_s,
        "settings": {"batches": list(cfg.batches), "prompt_len": cfg.prompt_len,
                     "gen_len": cfg.gen_len, "cache": cfg.cache,
                     "prefill": prefill_mode,
                     "graphs": bool(model._use_graphs), "reps": reps, "warmup": cfg.warmup,
                     "max_seconds": budget, "seed": cfg.seed},
        "load_s": load_s,
        "tensor_parallel": tp,
        "weight_bytes_per_rank": weights_per_rank,
        "measure_s": None,
        "wall_s": None,
        "peak_rss_bytes": None,
    })
    bar = _progress(cfg.progress, len(cfg.batches) * reps * (1 + cfg.gen_len),
                    f"bench {label[1]}")
    t_meas = time.perf_counter()

    def finish(interrupted: bool) -> dict:
        report.update({"measure_s": time.perf_counter() - t_meas,
                       "wall_s": time.perf_counter() - t_start,
                       "peak_rss_bytes": peak_rss_bytes()})
        if interrupted:
            report["interrupted"] = True
        elif peer is not None:
            report["hf"] = peer.section(results, prefill_mode)
        report.update(cfg.extra)
        return report
    try:
        if peer is not None:
            check_len = min(cfg.prompt_len, 64)
            peer.prepare(model, source, f"cuda:{getattr(be, 'device_id', 0)}" if on_gpu
                         else "cpu", np.random.default_rng([cfg.seed, 0, check_len])
                         .integers(0, meta.vocab_size, check_len).tolist())
        t_meas = time.perf_counter()
        for i, batch in enumerate(cfg.batches):
            share = None
            if budget is not None:
                left = budget - (time.perf_counter() - t_start)
                share = max(left, 0.0) / (len(cfg.batches) - i)
            if bar is not None:
                bar.set_postfix_str(f"batch {batch}")
            results.append(_run_batch(model, cfg, label, batch, reps, warm_len, seq_cap, share,
                                      copy_gb_s, bar, np.random.default_rng([cfg.seed, batch]),
                                      group, peer))
            if on_row is not None:
                if bar is not None:
                    bar.clear()   # the row's line goes where the bar was
                on_row(report, results[-1])
                if bar is not None:
                    bar.refresh()
    except KeyboardInterrupt as e:
        raise BenchInterrupted(finish(interrupted=True)) from e
    finally:
        if bar is not None:
            bar.close()
        model.teardown()
    return finish(interrupted=False)


def _check_finite_logits(model, n: int, rng) -> None:
    """NonFiniteLogits, before anything is timed, when one `n`-token prefill gives logits
    holding NaN / Inf (weights that do, an overflow): `generate` refuses such a model, and
    timing it would report the speed of a model that computes nothing."""
    from ..engine.sampler import nonfinite_message
    from ..errors import NonFiniteLogits
    seq = model.alloc_sequence()
    try:
        V = model.vocab_size()
        row = model.logits_to_numpy(model.prefill(rng.integers(0, V, n).tolist(), seq,
                                                  model.default_stream()))
    finally:
        model.free_sequence(seq)
    bad = int((~np.isfinite(row)).sum())
    if bad:
        raise NonFiniteLogits("bench: " + nonfinite_message(
            f"the logits of a {n}-token prompt's last position", bad, V) + "; nothing to "
            "measure")


def _run_batch(model, cfg, label, batch, reps, warm_len, seq_cap, share, copy_gb_s, bar,
               rng, group, peer=None) -> dict:
    """One batch size's row; `group`: prompts per timed prefill call (1: `prefill`)."""
    from ..model_engine import PrefillSlice
    be, meta = model.backend, model.metadata()
    stream = model.default_stream()
    on_gpu = roofline.is_device(be)
    t_batch = time.perf_counter()
    V = meta.vocab_size

    def prompt(n):
        return rng.integers(0, V, n).tolist()

    for _ in range(cfg.warmup):
        rows = Rows(model, cfg.cache, batch, seq_cap)
        try:
            first = model.argmax_on_device(model.prefill(prompt(warm_len), rows.seqs[0], stream),
                                           stream)
            for j in range(1, batch):
                if on_gpu:
                    model.prefill(prompt(warm_len), rows.seqs[j], stream)
                else:
                    rows.replicate(0, j, stream)
            toks = [first] * batch
            for _ in range(min(2, cfg.gen_len)):
                toks = model.argmax_batch(model.decode_batch(toks, rows.seqs, stream), batch,
                                          stream)
        finally:
            rows.close()
    be.synchronize(stream)
    be.reset_peak()
    if share is not None:
        share = max(share - (time.perf_counter() - t_batch), 0.0)
    per_rep = None if share is None else share / reps

    prefill_tps, ttft, decode_tps, hbm, itl, steps_done, timed_seqs = [], [], [], [], [], [], []
    for _ in range(reps):
        rows = Rows(model, cfg.cache, batch, seq_cap)
        try:
            t_rep = time.perf_counter()
            toks, prompts = [], []   # prompts: [B][prompt_len] ids held
            pre_times = []           # (sequences, seconds) per timed prefill call
            for j0 in range(0, batch, group):
                js = range(j0, min(batch, j0 + group))
                if j0 and per_rep is not None and \
                        time.perf_counter() - t_rep > 0.35 * per_rep:
                    for j in js:
                        rows.replicate(0, j, stream)
                        toks.append(toks[0])
                        prompts.append(prompts[0])
                    continue
                new = [prompt(cfg.prompt_len) for _ in js]
                prompts.extend(new)
                t0 = time.perf_counter()
                if group == 1:
                    ptrs = [model.prefill(new[0], rows.seqs[j0], stream)]
                else:
                    ptrs = model.prefill_batch_chunk(
                        [PrefillSlice(p, rows.seqs[j], 0, len(p), True)
                         for p, j in zip(new, js)], stream)
                toks.extend(model.argmax_on_device(ptr, stream) for ptr in ptrs)
                pre_times.append((len(js), time.perf_counter() - t0))
            if bar is not None:
                bar.update(1)
            be.synchronize(stream)
            n_timed = sum(n for n, _ in pre_times)
            prefill_tps.append(n_timed * cfg.prompt_len / sum(t for _, t in pre_times))
            ttft.append(pre_times[0][1] * 1e3)
            timed_seqs.append(n_timed)
            step_times, step_bytes = [], 0
            for step in range(cfg.gen_len):
                t0 = time.perf_counter()
                ptr = model.decode_batch(toks, rows.seqs, stream)
                toks = model.argmax_batch(ptr, batch, stream)
                step_times.append(time.perf_counter() - t0)
                step_bytes += roofline.model_step_bytes(model, [s.seq_len for s in rows.seqs])
                if bar is not None:
                    bar.update(1)
                if per_rep is not None and step + 1 >= _MIN_DECODE_STEPS and \
                        time.perf_counter() - t_rep > per_rep:
                    if bar is not None:
                        bar.update(cfg.gen_len - step - 1)
                    break
            total = sum(step_times)
            itl.extend(t * 1e3 for t in step_times)
            steps_done.append(len(step_times))
            decode_tps.append(batch * len(step_times) / total)
            if on_gpu and copy_gb_s:
                hbm.append(step_bytes / total / 1e9)
        finally:
            rows.close()
        if peer is not None:
            peer.after_rep(batch, prompts, len(step_times))
    hbm_gb_s = roofline.median(hbm) if on_gpu else None
    comm = tensor_parallel.comm_columns(model, stream, batch)
    return {
        "preset": label[0], "model": label[1],
        "batch": batch,
        "prompt_len": cfg.prompt_len,
        "gen_len": cfg.gen_len,
        "prefill_tokens_per_s": roofline.median(prefill_tps),
        "decode_tokens_per_s": roofline.median(decode_tps),
        "ttft_ms": roofline.median(ttft),
        "itl_ms_p50": roofline.percentile(itl, 50),
        "itl_ms_p99": roofline.percentile(itl, 99),
        "peak_memory_bytes": int(be.peak_bytes()),
        "hbm_gb_s": hbm_gb_s,
        "roofline_fraction": (hbm_gb_s / copy_gb_s) if hbm_gb_s and copy_gb_s else None,
        "cache": cfg.cache,
        "reps": reps,
        "prefill_seqs_timed": int(min(timed_seqs)),
        "decode_steps": int(min(steps_done)),
        **comm,
    }



def config_dict(cfg: BenchConfig) -> dict:
    return asdict(cfg)
