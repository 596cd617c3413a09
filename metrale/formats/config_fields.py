"""Typed reading of config.json fields, shared by every metadata parser (`metadata.py`,
`multimodal.py`): each error names the file and the key."""
from __future__ import annotations

import math

from ..errors import FormatError

# The widest head the attention, rope and KV-cache kernels take (ops/attention.py,
# ops/rope.py, ops/kv_cache.py, ops/dense_attention.py MAX_HEAD_DIM); they also need it even.
KERNEL_MAX_HEAD_DIM = 256
FLOAT32_MAX = 3.4028234663852886e38   # values the kernels take as float32 must fit


class _Cfg:
    """Typed access to one config dict; errors name the file and the key."""

    def __init__(self, d: dict, source: str) -> None:
        self.d, self.source = d, source

    def _get(self, key, default, required):
        v = self.d.get(key)
        if v is None:
            if required:
                raise FormatError(f"{self.source}: missing key {key!r} "
                                  f"(model_type {self.d.get('model_type')!r})")
            return default
        return v

    def int(self, key: str, default=None, *, required=False, positive=True) -> int | None:
        v = self._get(key, default, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or (positive and v <= 0):
            raise FormatError(f"{self.source}: {key} must be a "
                              f"{'positive ' if positive else ''}integer, got {v!r}")
        return v

    def float(self, key: str, default=None, *, required=False, gt=None, ge=None,
              f32=False) -> float:
        """A finite number (every float field: NaN and infinities are refused), `> gt` /
        `>= ge` when given: the range the field's formula needs; `f32`: finite as a
        float32 too (a kernel argument)."""
        v = self._get(key, default, required)
        if v is None:
            return None
        return number(v, key, self.source, gt=gt, ge=ge, f32=f32)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default, False)
        if not isinstance(v, bool):
            raise FormatError(f"{self.source}: {key} must be true or false, got {v!r}")
        return v


def number(v, what: str, source: str, *, gt=None, ge=None, f32=False) -> float:
    """`v` as a finite float (`> gt`, `>= ge` when given; `f32`: at most FLOAT32_MAX in
    magnitude), else FormatError naming the file, the field and the value."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FormatError(f"{source}: {what} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise FormatError(f"{source}: {what} must be a finite number, got {v!r}")
    if gt is not None and not f > gt:
        raise FormatError(f"{source}: {what} must be > {gt}, got {v!r}")
    if ge is not None and not f >= ge:
        raise FormatError(f"{source}: {what} must be >= {ge}, got {v!r}")
    if f32 and abs(f) > FLOAT32_MAX:
        raise FormatError(f"{source}: {what} {v!r} does not fit a float32 (the kernels "
                          "take it as one)")
    return f


def one_token_id(v, what: str, source: str) -> int:
    """A single token id (a one-element list is accepted, as HF does)."""
    ids = _token_ids(v, what, source)
    if len(ids) != 1:
        raise FormatError(f"{source}: {what} must be one token id, got {v!r}")
    return ids[0]


def token_ids_below(ids, what: str, source: str, vocab: int) -> tuple[int, ...]:
    """Token ids (already >= 0) that must index a vocabulary of `vocab` rows."""
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise FormatError(f"{source}: {what} holds token id {bad[0]}, not below vocab_size "
                          f"{vocab}")
    return tuple(ids)


def _token_ids(v, what: str, source: str) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise FormatError(f"{source}: {what} must be a token id or a list of them, got {v!r}")
    return tuple(vals)


def _pick(key: str, config: dict, gen: dict | None, fallback: dict | None = None):
    """generation_config.json wins over config.json (then over the text sub-config)."""
    for d in (gen, config, fallback):
        if d is not None and d.get(key) is not None:
            return d[key]
    return None
