"""A PEFT LoRA adapter's `adapter_config.json`: every field PEFT's `LoraConfig` saves is
honoured, ignored because it cannot change inference, or refused by name.

Honoured (the math of PEFT's `lora.Linear` in eval mode):
  r, lora_alpha, use_rslora      scaling = alpha / r, or alpha / sqrt(r) with rsLoRA, per
                                 module with that module's r and alpha
  rank_pattern, alpha_pattern    per-module r / alpha: the first key (in file order) for
                                 which the module name matches `(.*\\.)?(key)$`
  target_modules, exclude_modules, layers_to_transform, layers_pattern
                                 which modules carry a delta (targets.py: PEFT's rules)
  lora_dropout                   identity at inference, as in PEFT's eval mode
  fan_in_fan_out                 PEFT resets it to False for nn.Linear targets (all of ours)
Ignored (informational, or used only while training / initialising): peft_type "LORA" (any
other is refused), task_type CAUSAL_LM (or null), base_model_name_or_path, revision,
peft_version, inference_mode, auto_mapping, runtime_config, megatron_core,
qalora_group_size, ensure_weight_tying, and the init-time configs (eva_config, corda_config,
astra_config, lora_ga_config) when init_lora_weights leaves the base weights alone.
Refused by name: bias other than "none", modules_to_save, use_dora, lora_bias, use_qalora,
target_parameters (MoE expert parameters), trainable_token_indices, layer_replication,
megatron_config, alora_invocation_tokens, LoRA variants (velora, monteclora, kasa, bdlora,
arrow), loftq_config, an init_lora_weights that rewrites the base weights (pissa, olora,
corda, loftq, ...: the adapter is meant for a base this checkpoint is not), r outside
[1, MAX_RANK], a missing target_modules; and any field this reader does not know with a
value other than null / false / empty (a default cannot change the math).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import FormatError, Unsupported

MAX_RANK = 256        # the largest r (and per-module rank) a slot takes
CONFIG_FILE = "adapter_config.json"

# init_lora_weights values that only initialise A and B (the base weights untouched)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
_INFORMATIONAL = {"peft_version", "base_model_name_or_path", "revision", "inference_mode",
                  "auto_mapping", "runtime_config", "megatron_core", "qalora_group_size",
                  "ensure_weight_tying", "eva_config", "corda_config", "astra_config",
                  "lora_ga_config", "task_type", "peft_type", "init_lora_weights",
                  "lora_dropout", "fan_in_fan_out"}
_HONOURED = {"r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
             "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern"}
# field -> what it would mean, for the refusal (refused unless null / false / empty)
_REFUSED = {
    "modules_to_save": "whole modules trained and saved beside the adapter",
    "use_dora": "DoRA (a magnitude vector per module)",
    "lora_bias": "a bias on lora_B",
    "use_qalora": "QALoRA (pooled inputs)",
    "target_parameters": "LoRA on parameters (mixture-of-experts expert weights)",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "layers replicated into a deeper model",
    "megatron_config": "Megatron parallel LoRA layers",
    "alora_invocation_tokens": "activated LoRA (the delta starts at invocation tokens)",
    "velora_config": "the VeLoRA variant", "monteclora_config": "the MonteCLoRA variant",
    "kasa_config": "the KaSA variant", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing over several adapters",
    "loftq_config": "LoftQ (the base weights quantized and corrected)",
}


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that shape the math (see the module docstring)."""

    source: str                             # the file, for messages
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str   # names / suffixes, or one regex (fullmatch)
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    @property
    def all_linear(self) -> bool:
        return isinstance(self.target_modules, str) and \
            self.target_modules.lower() == "all-linear"

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, alpha) of `module` (an HF module name): PEFT's get_pattern_key rule."""
        return (_pattern(self.rank_pattern, module, self.r),
                _pattern(self.alpha_pattern, module, self.lora_alpha))

    def scaling(self, module: str) -> float:
        """alpha / r, or alpha / sqrt(r) with use_rslora, with the module's r and alpha."""
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern(patterns: dict, module: str, default):
    import re
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(directory: Path) -> AdapterConfig:
    """Parse and check `directory/adapter_config.json` (FormatError / Unsupported naming the
    file and the field)."""
    path = Path(directory) / CONFIG_FILE
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{directory}: no {CONFIG_FILE} (not a PEFT adapter directory)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: cannot read ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return parse_config(d, str(path))


def parse_config(d: dict, src: str) -> AdapterConfig:
    """The checks of `read_config` on an already-parsed dict."""
    def bad(key, why, cls=FormatError):
        raise cls(f"{src}: {key} {why}")
    if d.get("peft_type") != "LORA":
        bad("peft_type", f"is {d.get('peft_type')!r}: only LoRA adapters ('LORA') are served",
            Unsupported)
    if d.get("task_type") not in (None, "CAUSAL_LM"):
        bad("task_type", f"is {d['task_type']!r}: only CAUSAL_LM adapters are served "
            "(other task types train extra heads)", Unsupported)
    init = d.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        bad("init_lora_weights", f"is {init!r}: that initialisation rewrites the base weights, "
            "so the adapter belongs to a base this checkpoint is not (convert it to a plain "
            "LoRA adapter when saving)", Unsupported)
    if d.get("bias", "none") != "none":
        bad("bias", f"is {d['bias']!r}: trained biases of the base layers are not served "
            "(bias must be 'none')", Unsupported)
    for key, what in _REFUSED.items():
        if _set(d.get(key)):
            bad(key, f"is {d[key]!r}: {what} is not served", Unsupported)
    for key in d:
        if key not in _HONOURED | _INFORMATIONAL | set(_REFUSED) | {"bias"} and _set(d[key]):
            bad(key, f"= {d[key]!r} is a field this reader does not know; it is refused "
                "rather than ignored (an unknown setting may change the math)", Unsupported)
    r = _rank(d.get("r", 8), src, "r")
    alpha = _number(d.get("lora_alpha", 8), src, "lora_alpha")
    rank_pattern = _pattern_dict(d.get("rank_pattern"), src, "rank_pattern",
                                 lambda v, k: _rank(v, src, f"rank_pattern[{k!r}]"))
    alpha_pattern = _pattern_dict(d.get("alpha_pattern"), src, "alpha_pattern",
                                  lambda v, k: _number(v, src, f"alpha_pattern[{k!r}]"))
    rslora = d.get("use_rslora", False)
    if not isinstance(rslora, bool):
        bad("use_rslora", f"must be true or false, got {rslora!r}")
    targets = d.get("target_modules")
    if targets is None:
        bad("target_modules", "is missing: the adapter does not say which modules it adapts")
    return AdapterConfig(source=src, r=r, lora_alpha=alpha, use_rslora=rslora,
                         target_modules=_names(targets, src, "target_modules"),
                         exclude_modules=(None if d.get("exclude_modules") is None else
                                          _names(d["exclude_modules"], src, "exclude_modules")),
                         layers_to_transform=_layers(d.get("layers_to_transform"), src),
                         layers_pattern=_layer_patterns(d.get("layers_pattern"), src),
                         rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)


def _set(v) -> bool:
    """A value other than the defaults null / false / empty."""
    return not (v is None or v is False or v == {} or v == [] or v == "")


def _rank(v, src: str, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_RANK:
        raise Unsupported(f"{src}: {key} = {v!r}: a LoRA rank must be an integer in "
                          f"[1, {MAX_RANK}]")
    return v


def _number(v, src: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FormatError(f"{src}: {key} must be a finite number, got {v!r}")
    return float(v)


def _pattern_dict(v, src: str, key: str, check) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise FormatError(f"{src}: {key} must be an object of module patterns, got {v!r}")
    return {k: check(x, k) for k, x in v.items()}


def _names(v, src: str, key: str):
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise FormatError(f"{src}: {key} must be a list of module names or a regex, got {v!r}")


def _layers(v, src: str):
    if v is None or v == []:
        return None
    items = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(items, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              and x >= 0 for x in items):
        raise FormatError(f"{src}: layers_to_transform must be a layer index or a list of "
                          f"them, got {v!r}")
    return tuple(items)


def _layer_patterns(v, src: str):
    if v is None or v == [] or v == "":
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise FormatError(f"{src}: layers_pattern must be a name or a list of names, got {v!r}")
    return tuple(items)
