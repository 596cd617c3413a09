"""Scenarios of tests/tp/worker.py on mixture-of-experts checkpoints (tp/moe_shard.py
splits every expert's intermediate dimension): golden rows, the ranks' weight bytes,
decode_batch rows against solo steps. Each takes the worker's `Run`."""
from __future__ import annotations

import numpy as np

from tests.model.common import golden

MOE_TP_FIXTURES = ("qwen3_moe", "qwen2_moe", "mixtral")
# quantized experts cut packed: FP8 128x128 blocks (expert rows split inside a block, down
# columns from 72) and GPTQ act-order; at TP=4 the FP8 down slices start at 36 (off the
# 8 grid inside a block): refused by name, so TP=4 runs the GPTQ one
QUANT_MOE_TP = {2: ("q_moe_fp8_block", "q_moe_gptq_actorder"), 4: ("q_moe_gptq_actorder",)}
MOE_PREFIX = 12


def moe(run) -> None:
    for name in MOE_TP_FIXTURES + QUANT_MOE_TP[run.size]:
        m = run.load(name)
        ids = golden(name)["input_ids"][0].tolist()
        s = m.default_stream()
        seq = m.alloc_sequence()
        rows = [run.bits(m, m.prefill(ids[:MOE_PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[MOE_PREFIX:]]
        run.arrays[f"moe/{name}"] = np.concatenate(rows)
        m.free_sequence(seq)
        run.facts.setdefault("moe_weight_bytes", {})[name] = m.weight_bytes()
        lens = [3, 11, 1, 18]
        seqs, solo = [], []
        for n in lens:
            sq = m.alloc_sequence()
            m.prefill(ids[:n], sq, s)
            seqs.append(sq)
        batch = run.bits(m, m.decode_batch([ids[n] for n in lens], seqs, s), len(lens))
        for n in lens:
            sq = m.alloc_sequence()
            m.prefill(ids[:n], sq, s)
            solo.append(run.bits(m, m.decode(ids[n], sq, s)))
        run.arrays[f"moe_batch/{name}"] = batch
        run.arrays[f"moe_solo/{name}"] = np.concatenate(solo)
        m.teardown()
