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
        run.facts.setdefault(f"{key}/is_ep", {})[name] = m.is_ep()
        if m._tp.ep is not None:
            run.facts.setdefault(f"{key}/dispatched_rows", {})[name] = m._tp.ep.dispatched_rows
        m.teardown()


def moe(run) -> None:
    """Tensor parallelism inside every expert; and qwen2_moe's rows with decode graphs
    captured (the MoE block's collectives recorded and replayed like the dense ones)."""
    scenario(run, "moe", MOE_FIXTURES)
    m = run.load("qwen2_moe", graphs=True)
    run.arrays["moe/graphs/qwen2_moe"] = rows_of(run, m, "qwen2_moe")
    run.facts["moe/graphs_captured"] = len(m._graphs)
    m.teardown()


def moe_ep(run) -> None:
    """Expert parallelism: whole experts per rank, tokens dispatched by all-to-all; and the
    ModelEp contract's SPMD checks."""
    scenario(run, "moe_ep", MOE_FIXTURES, expert_parallel=True)
    ep_block_bits(run)
    m = run.load("mixtral", expert_parallel=True)
    m.ep_broadcast_cmd_for_seq(3, 0xFFFFFFF0)
    m.ep_broadcast_cmd(7)
    run.facts["ep_tokens"] = m.ep_broadcast_tokens([5, 6, 7])
    try:   # different words on the ranks: caught on every rank by the agreement
        m.ep_broadcast_cmd(run.rank)
    except Exception as e:   # noqa: BLE001 - recorded for the test
        run.facts["ep_mismatch"] = f"{type(e).__name__}: {e}"
    m.teardown()
    try:   # the routing is read back per layer: no decode graphs
        run.load("mixtral", expert_parallel=True, graphs=True).teardown()
    except Exception as e:   # noqa: BLE001 - recorded for the test
        run.facts["ep_graphs"] = f"{type(e).__name__}: {e}"


def ep_block_bits(run) -> None:
    """One MoE block (qwen2_moe layer 0, shared expert included) on 7 random rows, expert
    parallel on the ranks and on one process: written for the test to compare bit for bit."""
    import metrale
    from metrale.gpu_runtime import HostBackend
    from metrale.model_engine.moe import moe_mlp
    from tests.model.common import FIXTURES
    n = 7
    m = run.load("qwen2_moe", expert_parallel=True)
    one = metrale.load(FIXTURES / "qwen2_moe", HostBackend(), progress=False)
    hid = one._meta.hidden_size
    x = np.random.default_rng(5).standard_normal((n, hid)).astype(np.float32)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)   # BF16 bits (truncated: any bits do)
    for model in (m, one):
        s = model.default_stream()
        model.backend.copy_h2d(xb, model._ws.normed)
        moe_mlp(model, s, n, model._weights.layers[0].moe)
        model.backend.synchronize(s)
        out = np.empty((n, hid), np.uint16)
        model.backend.copy_d2h(model._ws.hidden, out)
        run.arrays[f"ep_block/{'ep' if model is m else 'one'}"] = out
    m.teardown()
    one.teardown()


def all_to_all_v(run) -> None:
    """The communicator's all_to_all_v: rank r sends (r + 1) * (q + 1) int32s to rank q,
    each its value 100 * r + q, and 0 to itself on even ranks."""
    from metrale.gpu_runtime.comm import open_communicator
    from metrale.gpu_runtime.comm.ranks import launcher_ranks
    b = run.backend()
    ranks = launcher_ranks()
    comm = open_communicator(b, ranks, timeout_s=60)
    r, N = ranks.rank, ranks.size

    def count(src, dst):
        return 0 if src == dst and src % 2 == 0 else (src + 1) * (dst + 1)
    send = np.concatenate([np.full(count(r, q), 100 * r + q, np.int32) for q in range(N)])
    recv_counts = [count(p, r) for p in range(N)]
    sp, rp = b.alloc(max(send.nbytes, 4)), b.alloc(4 * max(sum(recv_counts), 1))
    b.copy_h2d(send, sp)
    comm.all_to_all_v(sp, [count(r, q) for q in range(N)], rp, recv_counts, np.int32,
                      b.default_stream())
    comm.wait(b.default_stream())
    got = np.empty(sum(recv_counts), np.int32)
    b.copy_d2h(rp, got)
    run.arrays["a2av/got"] = got
    run.arrays["a2av/want"] = np.concatenate(
        [np.full(count(p, r), 100 * p + r, np.int32) for p in range(N)])
    b.free(sp)
    b.free(rp)
    comm.close()


def moe_emu(run) -> None:
    """On the emulator (the kernels' own sources): qwen2_moe's batch against each sequence
    alone, tensor parallel and expert parallel."""
    for key, options in (("moe", {}), ("moe_ep", {"expert_parallel": True})):
        m = run.load("qwen2_moe", **options)
        batch, solo = batch_and_solo(run, m, "qwen2_moe")
        run.arrays[f"emu/{key}/batch"], run.arrays[f"emu/{key}/solo"] = batch, solo
        m.teardown()
