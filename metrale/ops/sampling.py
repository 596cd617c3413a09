"""Token sampling (kernels/sampling.cu): launcher, params layout and the bit-exact twin.

Launcher::

    sample_rows(backend, stream, out_ptr, logits_ptr, logits_fp32, n_rows, vocab,
                params_ptr, seeds_ptr, steps_ptr, penalty_ids_ptr, penalty_counts_ptr,
                max_penalty_ids, workspace_ptr) -> None

- out: [n_rows] uint32 token ids.
- logits: [n_rows, vocab] BF16 (uint16 bits) or, with logits_fp32, float32.
- params: [n_rows] records of `PARAMS_DTYPE` (32 bytes each, little endian):
  offset 0 float32 temperature, 4 float32 top_p, 8 float32 min_p,
  12 float32 repetition_penalty, 16 int32 top_k, 20..31 reserved (zero).
  Build it with `pack_params`.
- seeds, steps: [n_rows] uint64; the draw of row r is keyed by (seeds[r], steps[r]).
- penalty_ids: [n_rows, max_penalty_ids] int32 and penalty_counts: [n_rows] int32, the ids
  already prompted/generated per row (ids outside [0, vocab) are ignored, duplicates are
  penalised once). Both may be NULL when max_penalty_ids == 0.
- workspace: `workspace_bytes(n_rows, vocab)` bytes of scratch, overwritten.

All per-row values are read from device buffers, so a captured CUDA graph replays with
whatever the buffers hold. The semantics, step by step, are in the header comment of
kernels/sampling.cu; in short: repetition penalty (HF rule), temperature (T <= 0 is the
device argmax rule over the penalised logits, equal to `metrale.ops.argmax` when the penalty
is 1), top_k, top_p, min_p (HF order), then a Philox4x32-10 draw. The weights are integer
masses trunc(exp(x - xmax) * 2^44) computed with a deterministic FP32 exp, so the kernel
and this twin choose the same token from the same inputs.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .argmax import argmax_rule
from .bf16 import bf16_to_f32
from .registry import twin

MODULE = "sampling"
THREADS = 1024
MAX_VOCAB = 1 << 19  # keeps vocab * 2^44 below 2^63
Q_SCALE = np.float32(2.0 ** 44)
EXP_FLOOR = np.float32(-80.0)
ONE_KEY = 0x3F800000  # bits of 1.0f

PARAMS_DTYPE = np.dtype({
    "names": ["temperature", "top_p", "min_p", "repetition_penalty", "top_k", "reserved"],
    "formats": ["<f4", "<f4", "<f4", "<f4", "<i4", ("<i4", (3,))],
    "offsets": [0, 4, 8, 12, 16, 20],
    "itemsize": 32,
})


def workspace_bytes(n_rows: int, vocab: int) -> int:
    """Scratch `sample_rows` needs: one float32 per logit."""
    return int(n_rows) * int(vocab) * 4


def pack_params(rows) -> np.ndarray:
    """[n] `PARAMS_DTYPE` records from objects with temperature, top_k, top_p, min_p and
    repetition_penalty attributes (e.g. `metrale.engine.sampling.SamplingParams`)."""
    rows = list(rows)
    out = np.zeros(len(rows), PARAMS_DTYPE)
    for i, p in enumerate(rows):
        out[i]["temperature"] = p.temperature
        out[i]["top_p"] = p.top_p
        out[i]["min_p"] = p.min_p
        out[i]["repetition_penalty"] = p.repetition_penalty
        out[i]["top_k"] = min(int(p.top_k), 2**31 - 1)
    return out


def _check(n_rows, vocab, max_penalty_ids, out_ptr, logits_ptr, params_ptr, seeds_ptr,
           steps_ptr, penalty_ids_ptr, penalty_counts_ptr, workspace_ptr) -> None:
    if n_rows < 1:
        raise InvalidArgument(f"sample_rows: n_rows must be >= 1, got {n_rows}")
    if not 1 <= vocab <= MAX_VOCAB:
        raise InvalidArgument(f"sample_rows: vocab must be in [1, {MAX_VOCAB}], got {vocab}")
    if max_penalty_ids < 0:
        raise InvalidArgument(f"sample_rows: max_penalty_ids must be >= 0, got {max_penalty_ids}")
    named = {"out_ptr": out_ptr, "logits_ptr": logits_ptr, "params_ptr": params_ptr,
             "seeds_ptr": seeds_ptr, "steps_ptr": steps_ptr, "workspace_ptr": workspace_ptr}
    if max_penalty_ids > 0:
        named.update(penalty_ids_ptr=penalty_ids_ptr, penalty_counts_ptr=penalty_counts_ptr)
    for name, ptr in named.items():
        if int(ptr) == 0:
            raise InvalidArgument(f"sample_rows: {name} is NULL")


def sample_rows(backend, stream: int, out_ptr, logits_ptr, logits_fp32: bool, n_rows: int,
                vocab: int, params_ptr, seeds_ptr, steps_ptr, penalty_ids_ptr,
                penalty_counts_ptr, max_penalty_ids: int, workspace_ptr) -> None:
    """Sample one token per row; see the module docstring for every argument."""
    n_rows, vocab, max_penalty_ids = int(n_rows), int(vocab), int(max_penalty_ids)
    _check(n_rows, vocab, max_penalty_ids, out_ptr, logits_ptr, params_ptr, seeds_ptr,
           steps_ptr, penalty_ids_ptr, penalty_counts_ptr, workspace_ptr)
    backend.launch(
        backend.kernel(MODULE, "sample_rows"), (n_rows,), (THREADS,), 0, stream,
        (DevicePtr(logits_ptr), np.int32(1 if logits_fp32 else 0), DevicePtr(out_ptr),
         np.int32(n_rows), np.int32(vocab), DevicePtr(params_ptr), DevicePtr(seeds_ptr),
         DevicePtr(steps_ptr), DevicePtr(int(penalty_ids_ptr or 0)),
         DevicePtr(int(penalty_counts_ptr or 0)), np.int32(max_penalty_ids),
         DevicePtr(workspace_ptr)))


# --------------------------------------------------------------------------- Philox
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 (Random123). counter: [..., 4], key: [..., 2] (uint32 values, any
    integer dtype); returns [..., 4] uint32."""
    c = [np.asarray(counter, np.uint64)[..., j] & _MASK32 for j in range(4)]
    k0 = np.asarray(key, np.uint64)[..., 0] & _MASK32
    k1 = np.asarray(key, np.uint64)[..., 1] & _MASK32
    for _ in range(10):
        p0 = _M0 * c[0]
        p1 = _M1 * c[2]
        hi0, lo0 = p0 >> _S32, p0 & _MASK32
        hi1, lo1 = p1 >> _S32, p1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return np.stack(c, axis=-1).astype(np.uint32)


def draw_word(seeds, steps) -> np.ndarray:
    """The 32-bit random word of each row: philox(counter=(step lo, hi, 0, 0),
    key=(seed lo, hi)) word 0. seeds, steps: [n] uint64 -> [n] uint64 (< 2^32)."""
    seeds = np.asarray(seeds, np.uint64)
    steps = np.asarray(steps, np.uint64)
    zero = np.zeros_like(steps)
    ctr = np.stack([steps & _MASK32, steps >> _S32, zero, zero], axis=-1)
    key = np.stack([seeds & _MASK32, seeds >> _S32], axis=-1)
    return philox4x32_10(ctr, key)[..., 0].astype(np.uint64)


def uniform(seeds, steps) -> np.ndarray:
    """The draw as a float64 in [0, 1): word / 2^32."""
    return draw_word(seeds, steps).astype(np.float64) / 2.0 ** 32


# --------------------------------------------------------------------------- FP32 math
_F = np.float32


def exp_det(d: np.ndarray) -> np.ndarray:
    """The kernel's exp_det bit for bit: exp(d) for d <= 0 in correctly rounded FP32 ops,
    0 below -80 (and for -inf)."""
    d = np.asarray(d, np.float32)
    ok = d >= EXP_FLOOR
    dd = np.where(ok, d, _F(0))
    n = np.rint(dd * _F(1.44269502))
    r = n * _F(0.693359375)
    np.subtract(dd, r, out=r)
    dd = n * _F(-2.12194440e-4)
    np.subtract(r, dd, out=r)
    p = np.full_like(r, _F(1.98412698e-4))
    for c in (1.38888889e-3, 8.33333333e-3, 4.16666667e-2, 1.66666667e-1, 0.5, 1.0, 1.0):
        np.multiply(p, r, out=p)
        np.add(p, _F(c), out=p)
    scale = n.astype(np.int32)
    scale += 127
    scale <<= 23
    np.multiply(p, scale.view(np.float32), out=p)
    p[~ok] = 0
    return p


def order_key(x: np.ndarray) -> np.ndarray:
    """Order-preserving uint32 key of non-NaN float32 values (-0 and +0 share one)."""
    i = (np.asarray(x, np.float32) + _F(0)).view(np.int32)  # -0 + 0 = +0
    flip = (i >> 31).view(np.uint32) | np.uint32(0x80000000)
    return i.view(np.uint32) ^ flip


def _sanitize(x: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(x), np.float32(-np.inf), x).astype(np.float32)


def _mass(e: np.ndarray) -> np.ndarray:
    return (e * Q_SCALE).astype(np.uint64)


def _mulhi32(z: np.ndarray, r: np.ndarray) -> np.ndarray:
    """floor(z * r / 2^32) for uint64 z < 2^63 and r < 2^32, exactly."""
    zh, zl = z >> _S32, z & _MASK32
    return zh * r + ((zl * r) >> _S32)


def sample_host(rows: np.ndarray, params: np.ndarray, seeds, steps, penalty_ids=None,
                penalty_counts=None) -> np.ndarray:
    """The kernel on host arrays. rows: [n, vocab] float32 (BF16 already widened);
    params: [n] PARAMS_DTYPE; seeds, steps: [n] uint64; penalty_ids: [n, m] int32 or None;
    penalty_counts: [n] int32. Returns [n] uint32."""
    with np.errstate(all="ignore"):  # inf - inf, x / T overflow: handled like the kernel
        return _sample_host(rows, params, seeds, steps, penalty_ids, penalty_counts)


def _sample_host(rows, params, seeds, steps, penalty_ids, penalty_counts) -> np.ndarray:
    rows = np.asarray(rows, np.float32)
    n, vocab = rows.shape
    params = np.asarray(params, PARAMS_DTYPE)
    temp = params["temperature"].astype(np.float32)
    greedy = ~(temp > 0)
    safe_t = np.where(greedy, np.float32(1), temp).astype(np.float32)[:, None]
    x = np.where(greedy[:, None], rows, rows / safe_t).astype(np.float32)
    pen = params["repetition_penalty"].astype(np.float32)
    if penalty_ids is not None and penalty_ids.shape[1] > 0:
        m = penalty_ids.shape[1]
        for r in np.nonzero(pen != np.float32(1))[0]:
            cnt = min(int(penalty_counts[r]), m)
            ids = penalty_ids[r, :max(cnt, 0)].astype(np.int64)
            ids = np.unique(ids[(ids >= 0) & (ids < vocab)])
            if ids.size == 0:
                continue
            lv = rows[r, ids]
            lp = np.where(lv > 0, lv / pen[r], lv * pen[r]).astype(np.float32)
            x[r, ids] = lp if greedy[r] else (lp / safe_t[r, 0]).astype(np.float32)
    x = _sanitize(x)
    out = np.zeros(n, np.uint32)
    if greedy.any():
        out[greedy] = argmax_rule(x[greedy])
    xmax = x.max(axis=1)
    live = ~greedy & (xmax > np.float32(-np.inf))
    if not live.any():
        return out
    idx = np.nonzero(live)[0]
    x, xmax, p = x[idx], xmax[idx], params[idx]
    nl = len(idx)

    # top_k on order keys of x
    k = p["top_k"].astype(np.int64)
    keys = order_key(x)
    kkey = np.zeros(nl, np.uint32)
    use_k = (k > 0) & (k < vocab)
    for kv in np.unique(k[use_k]):
        sel = np.nonzero(k == kv)[0]
        kkey[sel] = np.partition(keys[sel], vocab - kv, axis=1)[:, vocab - kv]
    d = (x - xmax[:, None]).astype(np.float32)
    e = np.zeros_like(x)
    live_k = (keys >= kkey[:, None]) & (d >= EXP_FLOOR)  # exp_det is 0 elsewhere
    e[live_k] = exp_det(d[live_k])
    e[(x == xmax[:, None]) & (keys >= kkey[:, None])] = np.float32(1)
    q = _mass(e)
    z = q.sum(axis=1)

    # top_p on the bits of e: lo = largest key value v with !(F(v) < Z * top_p)
    ebits = e.view(np.uint32)
    top_p = p["top_p"].astype(np.float32)
    pkey = np.zeros(nl, np.uint32)
    use_p = top_p < np.float32(1)
    if use_p.any():
        rs = np.nonzero(use_p)[0]
        sk = np.sort(ebits[rs], axis=1)[:, ::-1]  # q is a function of the key
        cum = np.cumsum(_mass(sk.view(np.float32)), axis=1, dtype=np.uint64)
        # F at each position = cum at the end of its tie group (keys descending)
        is_end = np.ones_like(sk, bool)
        is_end[:, :-1] = sk[:, :-1] != sk[:, 1:]
        big = np.uint64(np.iinfo(np.uint64).max)
        f = np.minimum.accumulate(np.where(is_end, cum, big)[:, ::-1], axis=1)[:, ::-1]
        limit = z[rs].astype(np.float64) * top_p[rs].astype(np.float64)
        keep_going = ~(f.astype(np.float64) < limit[:, None])
        anyk = keep_going.any(axis=1)
        first = np.argmax(keep_going, axis=1)
        pkey[rs] = np.where(anyk, sk[np.arange(len(rs)), first], np.uint32(0))

    min_p = p["min_p"].astype(np.float32)
    mp = np.where(min_p > 0, np.minimum(min_p, np.float32(1)), np.float32(0)).astype(np.float32)
    kept = (ebits >= pkey[:, None]) & (e >= mp[:, None])
    w = np.where(kept, q, np.uint64(0))
    cw = np.cumsum(w, axis=1, dtype=np.uint64)
    zf = cw[:, -1]
    word = draw_word(np.asarray(seeds, np.uint64)[idx], np.asarray(steps, np.uint64)[idx])
    target = _mulhi32(zf, word)
    out[idx] = np.argmax(cw > target[:, None], axis=1).astype(np.uint32)
    return out


@twin(MODULE, "sample_rows")
def sample_rows_twin(ctx, logits_ptr, logits_fp32, out_ptr, n_rows, vocab, params_ptr,
                     seeds_ptr, steps_ptr, penalty_ids_ptr, penalty_counts_ptr,
                     max_penalty_ids, workspace_ptr) -> None:
    n, v, m = int(n_rows), int(vocab), int(max_penalty_ids)
    if int(logits_fp32):
        rows = ctx.read(logits_ptr, n * v, np.float32).reshape(n, v)
    else:
        rows = bf16_to_f32(ctx.read(logits_ptr, n * v, np.uint16)).reshape(n, v)
    params = ctx.read(params_ptr, n, PARAMS_DTYPE)
    seeds = ctx.read(seeds_ptr, n, np.uint64)
    steps = ctx.read(steps_ptr, n, np.uint64)
    ids = counts = None
    if m > 0:
        ids = ctx.read(penalty_ids_ptr, n * m, np.int32).reshape(n, m)
        counts = ctx.read(penalty_counts_ptr, n, np.int32)
    ctx.view(workspace_ptr, n * v, np.float32)  # bounds check: the kernel writes all of it
    ctx.view(out_ptr, n, np.uint32)[:] = sample_host(rows, params, seeds, steps, ids, counts)
