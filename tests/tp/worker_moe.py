"""The mixture-of-experts scenarios of the tensor-parallel worker (tests/tp/worker.py): every
rank loads the MoE fixtures split over N ranks, tensor parallel inside every expert
(`moe`) or expert parallel (`moe_ep`), and writes the rows tests/tp/test_tp_moe.py checks
against TP=1, the HF goldens, each other and a batch."""
from __future__ import annotations

import numpy as np

from metrale.engine import generate
from tests.model.common import MOE_FIXTURES, golden

PREFIX = 12
GREEDY_PROMPT, GREEDY_NEW = 8, 16
BATCH_LENS = [3, 11, 1, 18, 7]


def rows_of(run, m, name: str) -> np.ndarray:
    """Prefill of the golden prompt's first PREFIX ids, then teacher-forced decode rows."""
    ids = golden(name)["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [run.bits(m, m.prefill(ids[:PREFIX], seq, s))]
    rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[PREFIX:]]
    m.free_sequence(seq)
    return np.concatenate(rows)


def batch_and_solo(run, m, name: str) -> tuple[np.ndarray, np.ndarray]:
    """decode_batch rows of sequences of mixed lengths, and each sequence decoded alone."""
    ids = golden(name)["input_ids"][0].tolist()
    s = m.default_stream()
    seqs = []
    for L in BATCH_LENS:
        seq = m.alloc_sequence()
        m.prefill(ids[:L], seq, s)
        seqs.append(seq)
    batch = run.bits(m, m.decode_batch([ids[L] for L in BATCH_LENS], seqs, s), len(seqs))
    for seq in seqs:
        m.free_sequence(seq)
    solo = []
    for L in BATCH_LENS:
        one = m.alloc_sequence()
        m.prefill(ids[:L], one, s)
        solo.append(run.bits(m, m.decode(ids[L], one, s)))
        m.free_sequence(one)
    return batch, np.concatenate(solo)


def scenario(run, key: str, names, **options) -> None:
    for name in names:
        m = run.load(name, **options)
        run.arrays[f"{key}/rows/{name}"] = rows_of(run, m, name)
        ids = golden(name)["input_ids"][0].tolist()
        run.arrays[f"{key}/greedy/{name}"] = np.array(
            generate(m, ids[:GREEDY_PROMPT], GREEDY_NEW, stop_token_ids=[]).tokens)
        batch, solo = batch_and_solo(run, m, name)
        run.arrays[f"{key}/batch/{name}"] = batch
        run.arrays[f"{key}/solo/{name}"] = solo
        run.facts.setdefault(f"{key}/weight_bytes", {})[name] = m.weight_bytes()
        run.facts.setdefault(f"{key}/reductions", {})[name] = m._tp.reductions
        m.teardown()


def moe(run) -> None:
    """Tensor parallelism inside every expert."""
    scenario(run, "moe", MOE_FIXTURES)


def moe_ep(run) -> None:
    """Expert parallelism: whole experts per rank, tokens dispatched by all-to-all."""
    scenario(run, "moe_ep", MOE_FIXTURES, expert_parallel=True)
