"""What the device can do, measured in the same run, and what a decode step must move.

- `copy_bandwidth(backend)`: a large device-to-device copy timed with events. The copy reads
  `n` bytes and writes `n` bytes, so the device's bandwidth is `2 n / t` (the convention of
  nvbandwidth and of the peak figures on data sheets). None on the host backend.
- `gemm_peak_tflops(backend)`: the cuBLAS BF16 GEMM (`backend.gemm_bf16`) at a large square
  size, timed with events. None on the host backend.
- `decode_step_bytes(meta, kv_lens)`: the bytes one decode step must read from device memory:
  every weight matrix the step multiplies by, plus the K and V of every cached position of
  every sequence. The embedding table is counted only for the rows gathered unless it is
  tied to the LM head (then the LM head reads all of it); every other weight is read whole,
  except a mixture-of-experts layer's routed experts: only those the step's tokens chose
  (the active bytes: top_k experts per layer at batch 1; for n rows the number expected
  under uniform routing, formats/moe_config.inactive_parameters). A hybrid model's step also
  moves each row's recurrent state, read and written (2x its bytes, as the copy bandwidth
  counts a copy's read and its write), and its K and V are those of the full-attention
  layers only.

`roofline_fraction = decode_step_bytes / step time / copy bandwidth`: 1.0 means the step ran
at the speed of a plain copy of the bytes it had to read.
"""
from __future__ import annotations

import statistics
from typing import Iterable

_GB = 1e9


def is_device(backend) -> bool:
    return getattr(backend, "name", "cpu").startswith("cuda")


def kv_bytes_per_token(meta) -> int:
    """K and V of one position in every layer that has them (a hybrid: its full-attention
    layers), BF16 (MLA: its latent row)."""
    from ..formats.deepseek_config import kv_bytes_per_token_layer
    hybrid = getattr(meta, "hybrid", None)
    layers = meta.num_layers if hybrid is None else len(hybrid.attention_layers)
    return layers * kv_bytes_per_token_layer(meta)


def state_step_bytes(meta) -> int:
    """The recurrent state a decode step moves per row: read and written (0 without)."""
    hybrid = getattr(meta, "hybrid", None)
    return 0 if hybrid is None else 2 * hybrid.state_bytes()


def weight_read_bytes(meta, n_rows: int, held: tuple[int, int] | None = None) -> int:
    """Weight bytes one decode step over `n_rows` rows reads (see the module docstring).
    `held`: (all weights, the embedding table) in the bytes the device holds when they are
    not weight_bytes(meta)'s BF16 (a GGUF kept packed: model_engine/gguf_weights.held_bytes)."""
    from ..formats.moe_config import inactive_parameters
    from ..model_engine.memory_plan import expert_bytes_per_parameter, weight_bytes
    weights, table = held or (weight_bytes(meta), meta.vocab_size * meta.hidden_size * 2)
    total = weights - int(expert_bytes_per_parameter(meta) * inactive_parameters(meta, n_rows))
    if not meta.tie_word_embeddings:
        total -= table - min(n_rows, meta.vocab_size) * (table // meta.vocab_size)
    return total


def decode_step_bytes(meta, kv_lens: Iterable[int], held: tuple[int, int] | None = None) -> int:
    """Bytes a decode step must read: weights + K/V of `kv_lens[i]` positions per row (the
    lengths after the step, i.e. including the position being written); `held` as
    weight_read_bytes takes it."""
    lens = [int(x) for x in kv_lens]
    return weight_read_bytes(meta, len(lens), held) + sum(lens) * kv_bytes_per_token(meta) + \
        len(lens) * state_step_bytes(meta)


def model_step_bytes(model, kv_lens: Iterable[int]) -> int:
    """`decode_step_bytes` of a loaded model on its device (its weights as held: a GGUF's
    kept packed): a tensor-parallel rank reads its own weight slices and KV heads only."""
    if model._tp is None:
        w = model._weights
        held = (int(w.nbytes), int(w.embed_bytes)) if hasattr(w, "embed_bytes") else None
        return decode_step_bytes(model.metadata(), kv_lens, held)
    return int(model._weights.nbytes) + \
        sum(int(x) for x in kv_lens) * kv_bytes_per_token(model._layer_meta)


def _time_events(backend, fn, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of fn(stream), timed with events."""
    stream = backend.default_stream()
    start, end = backend.create_event(), backend.create_event()
    out = []
    try:
        for _ in range(reps):
            backend.record_event(start, stream)
            fn(stream)
            backend.record_event(end, stream)
            backend.event_synchronize(end)
            out.append(backend.event_elapsed_ms(start, end))
    finally:
        for e in (start, end):
            destroy = getattr(backend, "destroy_event", None)
            if destroy is not None:
                destroy(e)
    return out


def copy_bandwidth(backend, nbytes: int | None = None, reps: int = 10) -> float | None:
    """Device copy bandwidth in GB/s (2 * bytes / time, best of `reps` after a warm-up);
    None on the host backend."""
    if not is_device(backend):
        return None
    if nbytes is None:
        nbytes = min(1 << 30, max(backend.free_memory() // 8, 64 << 20))
    nbytes = int(nbytes) & ~255
    src = backend.alloc(nbytes)
    dst = backend.alloc(nbytes)
    try:
        stream = backend.default_stream()
        backend.memset_async(src, 1, nbytes, stream)  # on the stream the copies run on
        backend.synchronize(stream)
        times = _time_events(backend, lambda s: backend.copy_d2d_async(src, dst, nbytes, s),
                             reps + 2)[2:]
    finally:
        backend.free(src)
        backend.free(dst)
    best = min(times)
    return 2 * nbytes / (best / 1e3) / _GB if best > 0 else None


def gemm_peak_tflops(backend, size: int = 8192, reps: int = 5) -> float | None:
    """cuBLAS BF16 GEMM TFLOP/s (2 m n k / time, best of `reps` after a warm-up) at m = n =
    k = `size`; None on the host backend."""
    if not is_device(backend):
        return None
    m = n = k = int(size)
    x = backend.alloc(m * k * 2)
    w = backend.alloc(n * k * 2)
    y = backend.alloc(m * n * 2)
    try:
        # 0x3C00 bf16 bits are small normal numbers; no NaN or Inf slows the GEMM down.
        stream = backend.default_stream()
        for p, nb in ((x, m * k * 2), (w, n * k * 2)):
            backend.memset_async(p, 0x3C, nb, stream)
        backend.synchronize(stream)
        times = _time_events(backend, lambda s: backend.gemm_bf16(m, n, k, x, w, y, s),
                             reps + 2)[2:]
    finally:
        for p in (x, w, y):
            backend.free(p)
    best = min(times)
    return 2.0 * m * n * k / (best / 1e3) / 1e12 if best > 0 else None


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def percentile(xs, q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of xs; None when empty."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
