"""Scenarios of tests/tp/worker.py on quantized checkpoints (tp/quant_weights.py splits
them packed): the golden rows of each fixture, its ranks' weight bytes, and decode_batch
rows against solo steps. Each takes the worker's `Run`."""
from __future__ import annotations

import numpy as np

from tests.model.common import golden

# FP8 block 128x128 with a row split inside a block (gate/up: 136 rows a rank) and a
# column split at 136 (down_proj), per-channel compressed-tensors FP8, GPTQ act-order, AWQ
QUANT_TP_FIXTURES = ("q_fp8_block", "q_ct_fp8_channel", "q_gptq_v2_actorder", "q_awq")
# at TP=4 q_fp8_block's down_proj slices start at 68 (inside a 128-column block, off the 8
# grid) and q_awq's o_proj slices cut its 64-column groups: both refused by name
QUANT_TP4_FIXTURES = ("q_ct_fp8_channel", "q_gptq_v2_actorder")
QUANT_PREFIX = 12


def quant(run) -> None:
    for name in QUANT_TP_FIXTURES if run.size == 2 else QUANT_TP4_FIXTURES:
        m = run.load(name)
        ids = golden(name)["input_ids"][0].tolist()
        s = m.default_stream()
        seq = m.alloc_sequence()
        rows = [run.bits(m, m.prefill(ids[:QUANT_PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[QUANT_PREFIX:]]
        run.arrays[f"quant/{name}"] = np.concatenate(rows)
        m.free_sequence(seq)
        run.facts.setdefault("quant_weight_bytes", {})[name] = m.weight_bytes()
        if name == "q_gptq_v2_actorder":   # decode_batch rows = solo decode steps
            lens = [3, 11, 1, 18]
            seqs = []
            for n in lens:
                sq = m.alloc_sequence()
                m.prefill(ids[:n], sq, s)
                seqs.append(sq)
            batch = run.bits(m, m.decode_batch([ids[n] for n in lens], seqs, s), len(lens))
            solo = []
            for n in lens:
                sq = m.alloc_sequence()
                m.prefill(ids[:n], sq, s)
                solo.append(run.bits(m, m.decode(ids[n], sq, s)))
            run.arrays["quant_batch"] = batch
            run.arrays["quant_solo"] = np.concatenate(solo)
        m.teardown()
