"""Typed reading of config.json fields, shared by every metadata parser (`metadata.py`,
`multimodal.py`): each error names the file and the key."""
from __future__ import annotations

from ..errors import FormatError


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

    def float(self, key: str, default=None, *, required=False) -> float:
        v = self._get(key, default, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise FormatError(f"{self.source}: {key} must be a number, got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default, False)
        if not isinstance(v, bool):
            raise FormatError(f"{self.source}: {key} must be true or false, got {v!r}")
        return v


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
