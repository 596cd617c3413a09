"""The LoRA scenario of the tensor-parallel worker (tests/tp/worker.py): every rank loads the
qwen2 fixture with two adapters (each rank its slices: tp/lora_shard.py) and writes the rows
tests/tp/test_tp_lora.py checks against TP=1, the HF + PEFT goldens, and each other."""
from __future__ import annotations

import numpy as np

from tests.model.common import golden
from tests.model.lora_util import adapter_dirs

NAMES = ["all_r16_rslora", "pattern_r4"]
PREFIX = 12


def lora(run) -> None:
    m = run.load("qwen2", loras=adapter_dirs(NAMES[:1]), max_loras=2, max_lora_rank=16)
    m.swap_lora_from_disk(adapter_dirs(NAMES[1:])[NAMES[1]], NAMES[1], 1)   # SPMD swap
    ids = golden("qwen2")["input_ids"][0].tolist()
    s = m.default_stream()
    for name in NAMES + [None]:   # prefill + teacher-forced decode, per adapter and the base
        seq = m.alloc_sequence(adapter=name)
        rows = [run.bits(m, m.prefill(ids[:PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[PREFIX:]]
        run.arrays[f"lora/{name}"] = np.concatenate(rows)
        m.free_sequence(seq)
    who, lens = [NAMES[0], None, NAMES[1], NAMES[0]], [5, 9, 3, 12]
    seqs = [m.alloc_sequence(adapter=a) for a in who]
    for q, L in zip(seqs, lens):
        m.prefill(ids[:L], q, s)
    run.arrays["lora/batch"] = run.bits(m, m.decode_batch([ids[L] for L in lens], seqs, s),
                                        len(seqs))
    solo = []
    for a, L in zip(who, lens):
        q = m.alloc_sequence(adapter=a)
        m.prefill(ids[:L], q, s)
        solo.append(run.bits(m, m.decode(ids[L], q, s)))
        m.free_sequence(q)
    run.arrays["lora/solo"] = np.concatenate(solo)
    for q in seqs:
        m.free_sequence(q)
    run.facts["lora_slots"] = [[x.name, x.rank, x.in_flight] for x in m.lora_slots()]
    run.facts["lora_weight_bytes"] = m._lora.nbytes
    m.teardown()
