"""A mixture-of-experts checkpoint's tensors under transformers 5's in-memory names, for
`--compare-hf` (compare_hf.build_hf_model copies the source's tensors into HF's state).

Checkpoints keep one tensor per expert and projection (formats/moe_config.py); transformers
5 stacks them at load (its conversion_mapping: MergeModulelist + Concatenate):
`mlp.experts.gate_up_proj` [E, 2I, hidden] = per expert [gate; up], `mlp.experts.down_proj`
[E, hidden, I], and mixtral's `block_sparse_moe.` becomes `mlp.`. gpt-oss checkpoints
already hold the stacked tensors under HF's names (nothing to rename).
"""
from __future__ import annotations

import numpy as np


def hf_state_renames(source) -> tuple[dict[str, object], set[str]]:
    """({HF state name: callable returning its BF16 bits}, checkpoint names consumed) for
    the MoE blocks of `source`; empty for a dense model."""
    meta = source.metadata()
    moe = meta.moe
    out: dict[str, object] = {}
    used: set[str] = set()
    if moe is None or moe.oss is not None:  # gpt-oss stores HF's stacked names as they are
        return out, used
    gate, up, down = moe.expert_proj
    for layer, sparse in enumerate(moe.sparse_layers):
        if not sparse:
            continue
        src = f"model.layers.{layer}.{moe.block}."
        dst = f"model.layers.{layer}.mlp."
        gu = [f"{src}experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in (gate, up)]
        dn = [f"{src}experts.{e}.{down}.weight" for e in range(moe.num_experts)]
        out[dst + "experts.gate_up_proj"] = _stack(source, gu, moe.num_experts)
        out[dst + "experts.down_proj"] = _stack(source, dn, moe.num_experts)
        used.update(gu + dn)
        if moe.block != "mlp":
            out[dst + "gate.weight"] = lambda name=src + "gate.weight": source.read_bf16(name)
            used.add(src + "gate.weight")
    return out, used


def _stack(source, names, E):
    def read():
        rows = np.concatenate([source.read_bf16(n) for n in names], axis=0)
        return rows.reshape(E, -1, rows.shape[-1])
    return read
