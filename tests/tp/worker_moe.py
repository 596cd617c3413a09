"""Scenarios of tests/tp/worker.py on mixture-of-experts checkpoints: tensor parallel
(`moe`: tp/moe_shard.py splits every expert's intermediate dimension) and expert parallel
(`moe_ep`: whole experts a rank, tp/expert_parallel.py): golden rows, the ranks' weight
bytes, decode_batch rows against solo steps; the communicator's all_to_all_v (`a2av`).
Each takes the worker's `Run`."""
from __future__ import annotations

import numpy as np

from metrale.engine import generate
from tests.model.common import MOE_FIXTURES, golden

MOE_TP_FIXTURES = ("qwen3_moe", "qwen2_moe", "mixtral")
# quantized experts cut packed: FP8 128x128 blocks (expert rows split inside a block, down
# columns from 72) and GPTQ act-order; at TP=4 the FP8 down slices start at 36 (off the
# 8 grid inside a block): refused by name, so TP=4 runs the GPTQ one
QUANT_MOE_TP = {2: ("q_moe_fp8_block", "q_moe_gptq_actorder"), 4: ("q_moe_gptq_actorder",)}
MOE_PREFIX = 12
# expert parallel: whole experts, so every quantized MoE fixture (AWQ's 32-groups included)
# runs packed as released; at N=4 the 6 experts split 1, 2, 1, 2
QUANT_MOE_EP = {2: ("q_moe_fp8_block", "q_moe_gptq_actorder", "q_moe_awq"),
                4: ("q_moe_gptq_actorder",)}
GREEDY_PROMPT, GREEDY_NEW = 8, 16
BATCH_LENS = [3, 11, 1, 18, 7]


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
    if run.device == "cpu" and run.size == 2:   # decode graphs: the MoE block's reduction
        m = run.load("qwen2_moe", graphs=True)  # recorded and replayed like the dense ones
        run.arrays["moe_graphs/qwen2_moe"] = rows_of(run, m, "qwen2_moe")
        run.facts["moe_graphs_captured"] = len(m._graphs)
        m.teardown()


def rows_of(run, m, name: str) -> np.ndarray:
    """Prefill of the golden prompt's first MOE_PREFIX ids, then teacher-forced decode rows."""
    ids = golden(name)["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [run.bits(m, m.prefill(ids[:MOE_PREFIX], seq, s))]
    rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[MOE_PREFIX:]]
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


def moe_ep(run) -> None:
    """Expert parallelism: whole experts per rank, tokens dispatched by all-to-all (BF16 and
    quantized experts); one MoE block against the one-process block; the ModelEp
    contract's SPMD checks; graphs refused."""
    for name in list(MOE_FIXTURES) + list(QUANT_MOE_EP[run.size]):
        m = run.load(name, expert_parallel=True)
        run.arrays[f"moe_ep/rows/{name}"] = rows_of(run, m, name)
        ids = golden(name)["input_ids"][0].tolist()
        run.arrays[f"moe_ep/greedy/{name}"] = np.array(
            generate(m, ids[:GREEDY_PROMPT], GREEDY_NEW, stop_token_ids=[]).tokens)
        batch, solo = batch_and_solo(run, m, name)
        run.arrays[f"moe_ep/batch/{name}"] = batch
        run.arrays[f"moe_ep/solo/{name}"] = solo
        run.facts.setdefault("moe_ep/weight_bytes", {})[name] = m.weight_bytes()
        run.facts.setdefault("moe_ep/is_ep", {})[name] = m.is_ep()
        run.facts.setdefault("moe_ep/dispatched_rows", {})[name] = m._tp.ep.dispatched_rows
        m.teardown()
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
    m = run.load("mixtral")
    run.facts["tp_is_ep"] = m.is_ep()
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


def moe_ep_emu(run) -> None:
    """On the emulator (the kernels' own sources), expert parallel: qwen2_moe's and the FP8
    MoE's rows, and qwen2_moe's batch against each sequence alone."""
    for name in ("qwen2_moe", "q_moe_fp8_block"):
        m = run.load(name, expert_parallel=True)
        run.arrays[f"emu_ep/rows/{name}"] = rows_of(run, m, name)
        if name == "qwen2_moe":
            batch, solo = batch_and_solo(run, m, name)
            run.arrays["emu_ep/batch"], run.arrays["emu_ep/solo"] = batch, solo
        m.teardown()
