"""Sampling parameters and the float64 definition of the distribution they select.

`SamplingParams` is what a user passes per request; `metrale.ops.sampling.pack_params`
turns a batch of them into the device params buffer that `sample_rows` reads (so one
captured graph serves any mix of settings). `filtered_distribution` is the host-side
definition the device sampler is tested against: the probabilities over the vocabulary
after repetition penalty, temperature, top_k, top_p and min_p, in Hugging Face's order.
"""
from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..ops.argmax import argmax_rule

__all__ = ["SamplingParams", "filtered_distribution", "resolve_seed"]


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"SamplingParams.{name} must be a real number, got "
                              f"{type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidArgument(f"SamplingParams.{name}: {value!r} is not a usable number "
                              f"({e})") from None
    if not math.isfinite(f):
        raise InvalidArgument(f"SamplingParams.{name} must be finite, got {value!r}")
    return f


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"SamplingParams.{name} must be an integer, got "
                              f"{type(value).__name__} {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    - temperature >= 0 (finite); 0 is greedy (the device argmax rule).
    - top_k >= 0; 0 (or >= vocab) keeps every token.
    - 0 < top_p <= 1; keep the highest-probability tokens whose mass above each is < top_p.
    - 0 <= min_p <= 1; drop tokens with probability < min_p * (top probability).
    - repetition_penalty > 0 (finite); 1 is off (HF rule: logit > 0 ? l / p : l * p).
    - seed: None (the engine picks one at random) or an int in [0, 2^64).

    A bad value raises `metrale.errors.InvalidArgument` naming the field. Values are stored
    normalised (floats as float, ints as int); the device sees them rounded to float32.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _real("temperature", self.temperature)
        if t < 0:
            raise InvalidArgument(f"SamplingParams.temperature must be >= 0, got {t}")
        k = _integer("top_k", self.top_k)
        if k < 0:
            raise InvalidArgument(f"SamplingParams.top_k must be >= 0, got {k}")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidArgument(f"SamplingParams.top_p must be in (0, 1], got {p}")
        mp = _real("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise InvalidArgument(f"SamplingParams.min_p must be in [0, 1], got {mp}")
        rp = _real("repetition_penalty", self.repetition_penalty)
        if not rp > 0:
            raise InvalidArgument(f"SamplingParams.repetition_penalty must be > 0, got {rp}")
        seed = self.seed
        if seed is not None:
            seed = _integer("seed", seed)
            if not 0 <= seed < 2**64:
                raise InvalidArgument(f"SamplingParams.seed must be in [0, 2^64), got {seed}")
        for name, v in (("temperature", t), ("top_k", k), ("top_p", p), ("min_p", mp),
                        ("repetition_penalty", rp), ("seed", seed)):
            object.__setattr__(self, name, v)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random 64-bit one when it has none."""
    return params.seed if params.seed is not None else secrets.randbits(64)


def filtered_distribution(logits_row: np.ndarray, params: SamplingParams,
                          prev_ids=()) -> np.ndarray:
    """float64 probabilities over the vocabulary that `params` samples from.

    logits_row: [vocab] values (BF16 logits already widened to float32); prev_ids: token
    ids already prompted/generated (ids outside [0, vocab) are ignored, repeats count once).
    Greedy params give the one-hot of the device argmax rule over the penalised FP32 row.
    Order: repetition penalty, temperature, top_k (ties with the k-th value kept), top_p
    over the renormalised softmax (keep a token iff the mass of strictly more probable
    tokens is < top_p), min_p (keep p >= min_p * max p); NaN logits are -inf.
    """
    row32 = np.asarray(logits_row, np.float32).reshape(-1)
    vocab = row32.size
    if vocab == 0:
        raise InvalidArgument("filtered_distribution: logits_row is empty")
    ids = np.unique(np.asarray(list(prev_ids), np.int64).reshape(-1))
    ids = ids[(ids >= 0) & (ids < vocab)]
    pen = params.repetition_penalty
    with np.errstate(all="ignore"):
        if params.is_greedy:
            x32 = row32.copy()
            if pen != 1 and ids.size:
                lv = row32[ids]
                p32 = np.float32(pen)
                x32[ids] = np.where(lv > 0, lv / p32, lv * p32)
            out = np.zeros(vocab)
            out[int(argmax_rule(x32[None])[0])] = 1.0
            return out
        x = row32.astype(np.float64)
        if pen != 1 and ids.size:
            lv = x[ids]
            x[ids] = np.where(lv > 0, lv / pen, lv * pen)
        x = x / params.temperature
        x[np.isnan(x)] = -np.inf
        if not np.any(x > -np.inf):
            out = np.zeros(vocab)
            out[0] = 1.0
            return out
        if 0 < params.top_k < vocab:
            kth = np.sort(x)[vocab - params.top_k]
            x[x < kth] = -np.inf
        m = x.max()
        if m == np.inf:
            probs = (x == m).astype(np.float64)
        else:
            probs = np.exp(x - m)
        probs /= probs.sum()
        if params.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            sp = probs[order]
            excl = np.concatenate(([0.0], np.cumsum(sp)[:-1]))
            start = np.ones(vocab, bool)
            start[1:] = sp[1:] != sp[:-1]
            first = np.maximum.accumulate(np.where(start, np.arange(vocab), 0))
            keep = np.empty(vocab, bool)
            keep[order] = excl[first] < params.top_p
            probs = np.where(keep, probs, 0.0)
            probs /= probs.sum()
        if params.min_p > 0:
            probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
    return probs
