"""The SPMD program of the tensor-parallel tests: run by `mpiexec -n N python -m
tests.tp.worker OUT DEVICE SCENARIO[,SCENARIO...]`, every rank the same calls through the
pointer API, as a user's program would.

Each rank writes OUT/rank<r>.npz (logits bits, token lists) and OUT/rank<r>.json (counts,
caught errors, a scenario's traceback if it failed); tests/tp/test_tp_mpi.py reads them and
asserts, against TP=1 and the golden HF outputs it computes itself. A scenario that fails
records its traceback and the next one runs (unless the group broke).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import metrale
from metrale.engine import Scheduler, generate, speculative_generate
from metrale.gpu_runtime import backend
from metrale.gpu_runtime.comm.ranks import launcher_ranks
from metrale.model_engine import PrefillSlice
from tests.model.common import DECODER_FIXTURES, FIXTURES, MOE_FIXTURES, golden
from tests.tp import worker_checkpoints, worker_lora, worker_moe, worker_quant, worker_streams

N = int(os.environ.get("METRALE_TP_TEST_SIZE", "2"))
# the dense decoders (mixture-of-experts checkpoints: worker_moe.py, test_tp_moe.py)
GOLDEN_FIXTURES = [n for n in DECODER_FIXTURES if n not in MOE_FIXTURES] + [
    "llama_attention_bias", "llama_mlp_bias", "qwen3_attention_bias", "mistral_window",
    "llama_tied_stored_head"]
PREFIX = 12            # prompt tokens prefilled; the rest of the golden ids are decoded
GREEDY_PROMPT, GREEDY_NEW = 8, 16
SOAK_REQUESTS = int(os.environ.get("METRALE_TP_SOAK_REQUESTS", "60"))


class Run:
    def __init__(self, out: Path, device: str) -> None:
        self.out, self.device = out, device
        self.rank = launcher_ranks().rank
        self.size = N
        self.arrays: dict[str, np.ndarray] = {}
        self.facts: dict = {"rank": self.rank, "device": device, "errors": {}, "seconds": {}}

    def backend(self):
        return backend(self.device)

    def load(self, name, **options):
        """Fixture `name` (or a checkpoint path) at TP=N."""
        return metrale.load(FIXTURES / name, self.backend(), tensor_parallel_size=N,
                            progress=False, **options)

    def bits(self, m, ptr, n: int = 1) -> np.ndarray:
        V = m.vocab_size()
        if m.logits_ptr_is_fp32(ptr):
            out = np.empty((n, V), np.float32)
        else:
            out = np.empty((n, V), np.uint16)
        m.copy_logits_to_host(ptr, out)
        return out

    def save(self) -> None:
        np.savez(self.out / f"rank{self.rank}.npz", **self.arrays)
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(self.facts, indent=1))


# scenarios ---------------------------------------------------------------------------------
def golden_rows(run: Run) -> None:
    """Prefill + teacher-forced decode rows of every fixture; greedy continuations; the
    weight bytes of each rank."""
    for name in GOLDEN_FIXTURES:
        m = run.load(name)
        ids = golden(name)["input_ids"][0].tolist()
        s = m.default_stream()
        seq = m.alloc_sequence()
        rows = [run.bits(m, m.prefill(ids[:PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[PREFIX:]]
        run.arrays[f"golden/{name}"] = np.concatenate(rows)
        m.free_sequence(seq)
        run.arrays[f"greedy/{name}"] = np.array(
            generate(m, ids[:GREEDY_PROMPT], GREEDY_NEW, stop_token_ids=[]).tokens)
        hf = FIXTURES / name / "greedy.npz"
        if hf.exists():   # HF's greedy continuation, teacher-forced: the argmax of each step
            with np.load(hf) as g:
                prompt, want = g["prompt"].tolist(), g["fp32"].tolist()
            seq = m.alloc_sequence()
            picks = [m.argmax_on_device(m.prefill(prompt, seq, s), s)]
            picks += [m.argmax_on_device(m.decode(t, seq, s), s) for t in want[:-1]]
            run.arrays[f"hf_greedy/{name}"] = np.array(picks)
            m.free_sequence(seq)
        run.facts.setdefault("weight_bytes", {})[name] = m.weight_bytes()
        run.facts.setdefault("pool_blocks", {})[name] = m.num_total_blocks()
        m.teardown()


def fp32_graphs(run: Run) -> None:
    """FP32 logits with decode graphs captured (host graphs record the MPI collectives and
    replay them), against eager."""
    name = "llama_gqa"
    ids = golden(name)["input_ids"][0].tolist()
    for graphs in (True, False):
        m = run.load(name, fp32_logits=True, graphs=graphs)
        s = m.default_stream()
        seq = m.alloc_sequence()
        rows = [run.bits(m, m.prefill(ids[:PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[PREFIX:]]
        run.arrays[f"fp32/graphs={graphs}"] = np.concatenate(rows)
        m.teardown()


def batch_invariance(run: Run, names=("llama_gqa", "llama_mqa_tied", "qwen2")) -> None:
    """decode_batch rows of mixed lengths against each sequence alone; and the two reduction
    schedules (gather, exchange) against each other."""
    for name in names:
        m = run.load(name)
        ids = golden(name)["input_ids"][0].tolist()
        s = m.default_stream()
        lens = [3, 11, 1, 18, 7]
        for schedule, limit in (("gather", None), ("exchange", 0)):
            if limit is not None:
                m._tp.gather_max_bytes = limit
            seqs = []
            for L in lens:
                seq = m.alloc_sequence()
                m.prefill(ids[:L], seq, s)
                seqs.append(seq)
            run.arrays[f"batch/{name}/{schedule}"] = run.bits(
                m, m.decode_batch([ids[L] for L in lens], seqs, s), len(lens))
            run.facts.setdefault("argmax_batch", {})[f"{name}/{schedule}"] = \
                m.argmax_batch(m.logits_buffer_ptr(), len(lens), s)
            solo = []
            for L in lens:
                one = m.alloc_sequence()
                m.prefill(ids[:L], one, s)
                solo.append(run.bits(m, m.decode(ids[L], one, s)))
                m.free_sequence(one)
            run.arrays[f"solo/{name}/{schedule}"] = np.concatenate(solo)
            for seq in seqs:
                m.free_sequence(seq)
        m.teardown()


def verify_rows(run: Run) -> None:
    """decode_verify rows against decode steps at the same positions."""
    name = "llama_gqa"
    m = run.load(name)
    ids = golden(name)["input_ids"][0].tolist()
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill(ids[:10], seq, s)
    out = m.decode_verify(ids[10:16], seq, s)
    run.arrays["verify/rows"] = run.bits(m, m.logits_buffer_ptr(), 6)
    run.facts["verify_ids"] = out
    ref = m.alloc_sequence()
    m.prefill(ids[:10], ref, s)
    run.arrays["verify/decode"] = np.concatenate([run.bits(m, m.decode(t, ref, s))
                                                  for t in ids[10:16]])
    # prefill chunks + a mixed step, against whole prefills
    a, b = m.alloc_sequence(), m.alloc_sequence()
    rows_ptr, ptrs = m.mixed_forward_batch(
        [ids[16]], [ref], [PrefillSlice(ids[:9], a, 0, 9, True),
                           PrefillSlice(ids[:20], b, 0, 8, False)], s)
    run.arrays["mixed/rows"] = run.bits(m, m.logits_buffer_ptr(), 2)
    run.facts["mixed_null"] = [p.is_null() for p in ptrs]
    m.teardown()


def speculative(run: Run) -> None:
    """speculative_generate (TP=2 target and draft) against plain greedy."""
    target, draft = run.load("llama_gqa"), run.load("qwen3")
    prompt = golden("llama_gqa")["input_ids"][0, :9].tolist()
    want = generate(target, prompt, 20, stop_token_ids=[]).tokens
    run.facts["spec"] = {"greedy": want}
    for k in (1, 3, 5):
        r = speculative_generate(target, draft, prompt, 20, k=k, stop_token_ids=[])
        run.facts["spec"][f"k={k}"] = r.tokens
        run.facts["spec"][f"k={k} accepted"] = [r.accepted, r.proposed]
    run.facts["spec"]["free"] = [target.num_free_blocks(), target.num_total_blocks()]
    target.teardown()
    draft.teardown()


def soak(run: Run) -> None:
    """The reference scheduler (tests/reliability/test_soak.py, bounded) on a pool small
    enough to preempt; every output against a solo greedy run."""
    be = backend(run.device)
    m = metrale.load(FIXTURES / "llama_gqa", be, tensor_parallel_size=N, progress=False,
                     kv_blocks=24, block_size=4, max_batch=16)
    live0 = be.live_bytes()
    rng = np.random.default_rng(2026)
    shared = rng.integers(4, 256, 8).tolist()
    sched = Scheduler(m, chunk_tokens=48)
    reqs, cancelled, submitted = {}, set(), 0
    while submitted < SOAK_REQUESTS or sched.has_work():
        for _ in range(int(rng.integers(0, 7))):
            if submitted < SOAK_REQUESTS:
                prompt = rng.integers(4, 256, int(rng.integers(1, 30))).tolist()
                if rng.random() < 0.3:
                    prompt = shared + prompt
                n = int(rng.integers(1, 25))
                reqs[sched.add_request(prompt, n, stop_token_ids=[3])] = (prompt, n)
                submitted += 1
        if rng.random() < 0.03 and sched.running:
            victim = sched.running[int(rng.integers(0, len(sched.running)))].request_id
            if sched.cancel(victim):
                cancelled.add(victim)
        if sched.has_work():
            sched.step()
    mismatches, solo = [], {}
    for rid, (prompt, n) in reqs.items():
        r = sched.finished[rid]
        if rid in cancelled:
            continue
        key = (tuple(prompt), n)
        if key not in solo:
            solo[key] = generate(m, prompt, n, stop_token_ids=[3]).tokens
        if r.output != solo[key]:
            mismatches.append(rid)
    m.reclaim_prefix_blocks(m.num_total_blocks())
    run.facts["soak"] = {"requests": len(sched.finished), "cancelled": len(cancelled),
                         "preemptions": sched.preemptions, "steps": sched.steps,
                         "mismatches": mismatches,
                         "blocks_back": m.num_free_blocks() == m.num_total_blocks(),
                         "bytes_back": be.live_bytes() == live0}
    m.teardown()


def failures(run: Run) -> None:
    """Errors on one rank raised on every rank; different calls refused; the model usable
    after each."""
    m = run.load("llama_gqa", kv_blocks=8, block_size=4)
    ids = golden("llama_gqa")["input_ids"][0].tolist()
    s = m.default_stream()
    seen = run.facts.setdefault("caught", {})

    def attempt(key, fn):
        try:
            fn()
            seen[key] = None
        except metrale.MetraleError as e:
            seen[key] = [type(e).__name__, str(e)]

    seq = m.alloc_sequence()
    # a bad token id on rank 1 only: rank 0's checks pass, it still raises rank 1's error
    bad = [5, 6, 999] if run.rank == 1 else [5, 6, 7]
    attempt("bad_token_one_rank", lambda: m.prefill(bad, seq, s))
    # the same bad input on every rank (the usual SPMD case)
    attempt("bad_token_all", lambda: m.prefill([1, 2, 4096], seq, s))
    # CacheFull on rank 1 only: its pool is short (blocks promised to another sequence)
    hog = m.alloc_sequence()
    if run.rank == 1:
        m.reserve_blocks(hog, 7 * 4)
    attempt("cache_full_one_rank", lambda: m.prefill(ids[:20], seq, s))
    m.free_sequence(hog)
    # different calls on the ranks
    other = m.alloc_sequence()
    m.prefill(ids[:4], other, s)
    attempt("different_calls", (lambda: m.decode(ids[4], other, s)) if run.rank == 0 else
            (lambda: m.decode(ids[5], other, s)))
    # a bad pointer on rank 0 only, in a call with no collective
    attempt("bad_pointer_one_rank",
            lambda: m.argmax_on_device(m.logits_buffer_ptr().offset(1 << 40) if run.rank == 0
                                       else m.logits_buffer_ptr(), s))
    # the model after all that: the same rows as a fresh sequence's
    seen["seq_state"] = [seq.seq_len, len(seq.block_table), other.seq_len]
    m.free_sequence(other)
    fresh = m.alloc_sequence()
    run.arrays["after_errors"] = run.bits(m, m.prefill(ids[:10], fresh, s))
    run.facts["pool_after_errors"] = [m.num_free_blocks(), m.num_total_blocks()]
    m.teardown()


def comm_protocol(run: Run) -> None:
    """Every collective of the MPI communicator on device pointers, and in a host graph."""
    from metrale.gpu_runtime.comm import open_communicator
    be = backend(run.device)
    comm = open_communicator(be, launcher_ranks(), timeout_s=60)
    r, n = comm.rank, comm.size
    got = {}

    def buf(arr):
        p = be.alloc(arr.nbytes)
        be.copy_h2d(np.ascontiguousarray(arr), p)
        return p

    def get(p, count, dt):
        out = np.empty(count, dt)
        be.copy_d2h(p, out)
        return out
    send = buf(np.arange(5, dtype=np.float32) + 10 * r)
    recv = buf(np.zeros(5 * n, np.float32))
    comm.all_gather(send, recv, 5, np.float32, 0)
    got["all_gather"] = get(recv, 5 * n, np.float32).tolist()
    a2a_send = buf((np.arange(3 * n, dtype=np.int32) + 100 * r))
    a2a_recv = buf(np.zeros(3 * n, np.int32))
    comm.all_to_all(a2a_send, a2a_recv, 3, np.int32, 0)
    got["all_to_all"] = get(a2a_recv, 3 * n, np.int32).tolist()
    red = buf(np.full(4, r + 1, np.int32))
    comm.all_reduce(red, red, 4, np.int32, 0)
    got["all_reduce"] = get(red, 4, np.int32).tolist()
    bc = buf(np.full(6, 7 + r, np.uint16))
    comm.broadcast(bc, 6, np.uint16, n - 1, 0)
    got["broadcast"] = get(bc, 6, np.uint16).tolist()
    comm.barrier(0)
    got["exchange"] = [x.decode() for x in comm.exchange(f"rank {r}".encode())]
    # captured: the collective replays with the buffers' contents at replay time
    be.begin_capture(0)
    comm.all_gather(send, recv, 5, np.float32, 0)
    g = be.end_capture(0)
    be.copy_h2d(np.arange(5, dtype=np.float32) * -1 - r, send)
    be.launch_graph(g, 0)
    got["graph_all_gather"] = get(recv, 5 * n, np.float32).tolist()
    be.destroy_graph(g)
    try:
        comm.all_reduce(send, recv, 5, np.uint16, 0)
    except metrale.InvalidArgument as e:
        got["bf16_all_reduce"] = str(e)
    comm.close()
    # NCCL's unique id from rank 0 to every rank over MPI (the mpiexec path of gpu_runtime/comm/nccl.py)
    from metrale.gpu_runtime.comm.nccl import share_unique_id

    class OwnIds:   # each rank would make its own id: only rank 0's may survive
        @staticmethod
        def get_unique_id():
            return bytes([65 + r]) * 128
    got["nccl_unique_id"] = share_unique_id(OwnIds, launcher_ranks(), 30, None)[:4].decode()
    for p in (send, recv, a2a_send, a2a_recv, red, bc):
        be.free(p)
    run.facts["comm"] = got


# failure launches (each its own mpiexec: the job ends) ------------------------------------
def stall(run: Run) -> None:
    """Rank 1 stops calling the model; rank 0's next step must fail within the timeout."""
    m = run.load("llama_gqa", tp_timeout_s=3)
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill([1, 2, 3], seq, s)
    if run.rank == 1:
        time.sleep(60)
        return
    t0 = time.monotonic()
    try:
        m.decode(4, seq, s)
        print("STALL: decode returned", flush=True)
    except metrale.TensorParallelError as e:
        print(f"STALL: rank 0 raised after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        raise


def kill(run: Run) -> None:
    """Rank 1 dies (SIGKILL) between steps; rank 0 must not hang."""
    m = run.load("llama_gqa", tp_timeout_s=5)
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill([1, 2, 3], seq, s)
    if run.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for t in range(4, 40):
        m.decode(t, seq, s)
    print("KILL: rank 0 decoded past a dead peer", flush=True)


def emu_batch(run: Run) -> None:
    """Batch invariance on one fixture (on emu: the kernels' own sources)."""
    batch_invariance(run, ("llama_gqa",))


SCENARIOS = {"golden": golden_rows, "emu_batch": emu_batch, "fp32_graphs": fp32_graphs,
             "batch": batch_invariance, "verify": verify_rows, "spec": speculative,
             "soak": soak, "failures": failures, "comm": comm_protocol, "stall": stall,
             "kill": kill, "nonfinite": worker_checkpoints.nonfinite,
             "gguf": worker_checkpoints.gguf, "streams": worker_streams.streams,
             "lora": worker_lora.lora, "quant": worker_quant.quant,
             "moe": worker_moe.moe, "moe_ep": worker_moe.moe_ep,
             "a2av": worker_moe.all_to_all_v, "moe_ep_emu": worker_moe.moe_ep_emu}


def main(argv) -> int:
    out, device, names = Path(argv[1]), argv[2], argv[3].split(",")
    run = Run(out, device)
    for name in names:
        t0 = time.perf_counter()
        try:
            SCENARIOS[name](run)
        except metrale.TensorParallelError:
            run.facts["errors"][name] = traceback.format_exc()
            run.save()
            raise   # the group is broken: nothing more can run
        except Exception:
            run.facts["errors"][name] = traceback.format_exc()
        run.facts["seconds"][name] = time.perf_counter() - t0
        run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
