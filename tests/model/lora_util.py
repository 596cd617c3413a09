"""Shared by the LoRA model tests: the fixture adapters, random adapters for any base, and
running a prompt through a model under an adapter."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from metrale.formats.lora import base_modules
from tests.formats.st_util import tensors_bytes
from tests.model.common import FIXTURES, logits_rows

LORA = FIXTURES / "lora"
ADAPTERS = ["qv_r8", "all_r16_rslora", "pattern_r4", "mlp_layer1_r64"]


def adapter_dirs(names=ADAPTERS) -> dict[str, Path]:
    return {n: LORA / n for n in names}


def lora_golden(name: str) -> dict:
    with np.load(LORA / name / "golden.npz") as g:
        return {k: g[k] for k in g.files}


def write_adapter(path: Path, meta, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                  r: int = 4, alpha: float = 8.0, seed: int = 0) -> Path:
    """A PEFT-layout adapter of random A, B (F32) for a base of metadata `meta`."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
         "target_modules": list(targets), "bias": "none"}))
    tensors = {}
    for mod in base_modules(meta):
        if mod.shape is None or mod.kind.split(".")[1] not in targets:
            continue
        n, k = mod.shape
        key = f"base_model.model.{mod.name}"
        tensors[key + ".lora_A.weight"] = ("F32", rng.standard_normal((r, k)) / np.sqrt(k))
        tensors[key + ".lora_B.weight"] = ("F32", rng.standard_normal((n, r)) * 0.3 /
                                           (alpha / r) / np.sqrt(r))
    (path / "adapter_model.safetensors").write_bytes(tensors_bytes(tensors))
    return path


def run_prompt(m, ids, decode_from: int, adapter=None) -> np.ndarray:
    """Logits rows: the prefill of ids[:decode_from], then one decode per later token."""
    s = m.default_stream()
    seq = m.alloc_sequence(adapter=adapter)
    rows = [logits_rows(m, m.prefill(ids[:decode_from], seq, s))[0]]
    for t in ids[decode_from:]:
        rows.append(logits_rows(m, m.decode(t, seq, s))[0])
    m.free_sequence(seq)
    return np.stack(rows)


def bits(m, ptr, n: int = 1) -> np.ndarray:
    """The logits rows' raw bits (uint16 BF16, or FP32 as uint32)."""
    if m.logits_ptr_is_fp32(ptr):
        out = np.empty((n, m.vocab_size()), np.uint32)
    else:
        out = np.empty((n, m.vocab_size()), np.uint16)
    m.copy_logits_to_host(ptr, out.view(np.uint8).reshape(-1))
    return out
