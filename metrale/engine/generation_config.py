"""Sampling defaults from a checkpoint's generation_config.json, with Hugging Face's meaning.

`do_sample` false (or absent) is greedy decoding whatever `temperature` says; with
`do_sample` true the sampling settings are `temperature` (default 1.0), `top_k` (default 50,
`null` keeps every token), `top_p` (1.0) and `min_p` (off). `repetition_penalty` applies
in both modes. The length is `max_new_tokens`, else `max_length` minus the prompt.
Settings the user gives win over all of these.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Mapping

from ..errors import FormatError
from .sampling import SamplingParams

# transformers' GenerationConfig defaults for the fields a sampling run reads
HF_TEMPERATURE, HF_TOP_K, HF_TOP_P = 1.0, 50, 1.0


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json asks for: `sampling` settings as keyword arguments of
    `SamplingParams`, and the length fields (None when absent)."""

    sampling: dict
    max_new_tokens: int | None = None
    max_length: int | None = None

    def sampling_params(self, **overrides) -> SamplingParams:
        """`SamplingParams` of the defaults with every non-None override applied."""
        known = {f.name for f in fields(SamplingParams)}
        merged = {**self.sampling, **{k: v for k, v in overrides.items() if v is not None}}
        return SamplingParams(**{k: v for k, v in merged.items() if k in known})

    def new_tokens(self, prompt_len: int, fallback: int) -> int:
        """Tokens to generate after a prompt of `prompt_len` when the user gave no count."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None and self.max_length > prompt_len:
            return self.max_length - prompt_len
        return fallback


def _number(gen: Mapping, key: str, default, where: str, integer: bool = False):
    v = gen.get(key, default)
    if v is None:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(v, bool) or not isinstance(v, kind):
        raise FormatError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, "
                          f"got {v!r}")
    if not math.isfinite(v) or v < 0:   # every one of these is a count, a scale or a mass
        raise FormatError(f"{where}: {key} must be a finite number >= 0, got {v!r}")
    return int(v) if integer else float(v)


def generation_defaults(gen: Mapping | None,
                        where: str = "generation_config.json") -> GenerationDefaults:
    """The defaults a generation_config.json dict (None: no file) asks for."""
    if not gen:
        return GenerationDefaults(sampling={})
    sampling: dict = {}
    rp = _number(gen, "repetition_penalty", None, where)
    if rp is not None:
        sampling["repetition_penalty"] = rp
    if gen.get("do_sample") is True:
        sampling["temperature"] = _number(gen, "temperature", HF_TEMPERATURE, where)
        top_k = _number(gen, "top_k", HF_TOP_K, where, integer=True)
        sampling["top_k"] = 0 if top_k is None else top_k
        top_p = _number(gen, "top_p", HF_TOP_P, where)
        sampling["top_p"] = 1.0 if top_p is None else top_p
        min_p = _number(gen, "min_p", None, where)
        if min_p is not None:
            sampling["min_p"] = min_p
    else:
        sampling["temperature"] = 0.0
    return GenerationDefaults(sampling=sampling,
                              max_new_tokens=_number(gen, "max_new_tokens", None, where,
                                                     integer=True),
                              max_length=_number(gen, "max_length", None, where, integer=True))
