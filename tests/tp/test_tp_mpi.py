"""Tensor parallelism at TP=2 over MPI, on the CPU: one `mpiexec -n 2` run of the worker's
scenarios (tests/tp/worker.py), checked here against TP=1 and the golden HF outputs.

Proven: goldens of every decoder fixture through the pointer API; every rank gets the same
rows; TP=2 within the BF16 tolerance of TP=1 and greedy tokens equal; a sequence's rows are
the same bits alone or in a batch, under both reduction schedules; verify rows equal decode
steps; speculative equals greedy; the reference scheduler's soak; each rank's weights about
1/2; errors on one rank raised on both; NaN weights on one rank's slice raise the same
NonFiniteLogits on both; GGUF checkpoints; the stream rules of one device (argmax on the
default stream after the caller's); the communicator's collectives; a stalled or dead peer
ends the job instead of hanging it.
"""
import numpy as np
import pytest

import metrale
from metrale.engine import generate
from metrale.gpu_runtime import HostBackend
from metrale.ops.argmax import argmax_rule
from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import emu_available
from tests.model.common import (FIXTURES, assert_matches_golden, golden, load, logits_rows,
                                rel_err)
from tests.tp.launch import Results, run_worker
from tests.tp.worker import GOLDEN_FIXTURES, GREEDY_NEW, GREEDY_PROMPT, PREFIX
from tests.tp.worker_checkpoints import (GGUF_END, GGUF_FIXTURES, GGUF_MODELS, GGUF_PREFIX,
                                         NAN_PROMPT)

SCENARIOS = "golden,fp32_graphs,batch,verify,spec,soak,failures,comm,nonfinite,gguf,streams"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    proc = run_worker(out, "cpu", SCENARIOS)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


def tp1_rows(name: str) -> np.ndarray:
    """The worker's golden rows, computed on one device."""
    m = load(name)
    ids = golden(name)["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:PREFIX], seq, 0))]
    rows += [logits_rows(m, m.decode(t, seq, 0)) for t in ids[PREFIX:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("name", GOLDEN_FIXTURES)
def test_goldens_and_tp1(tp2, name):
    tp2.check_scenario("golden")
    got = bf16_to_f32(tp2.same_on_every_rank(f"golden/{name}"))
    g = golden(name)
    assert_matches_golden(got, g["logits"][PREFIX - 1:], f"{name} TP=2")
    one = tp1_rows(name)
    # BF16 logits: FP32 partial sums added in another order move a row by a few BF16 ulps
    assert rel_err(got, one) < 0.02, f"{name}: TP=2 vs TP=1"
    m = load(name)
    want = generate(m, g["input_ids"][0, :GREEDY_PROMPT].tolist(), GREEDY_NEW,
                    stop_token_ids=[]).tokens
    assert tp2.same_on_every_rank(f"greedy/{name}").tolist() == want


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_tied", "mistral", "qwen2", "qwen3"])
def test_greedy_agrees_with_hf_where_its_precisions_agree(tp2, name):
    """tests/fixtures/make_greedy.py: HF's float32 and bfloat16 greedy continuations of the
    same prompt, each step's top-2 margin. Teacher-forced along HF's float32 continuation,
    TP=2's device argmax picks HF's token at every step where the two HF precisions agree
    and the step is not a near-tie (float32 top-2 margin >= 0.05, the golden tests' rule:
    one BF16 ulp at |logit| ~1 is 0.008; these random tiny models have steps with margins of
    0.002-0.012, where any BF16 engine may pick the runner-up)."""
    with np.load(FIXTURES / name / "greedy.npz") as g:
        prompt, fp32, bf16, margin = g["prompt"], g["fp32"], g["bf16"], g["fp32_margin"]
    assert prompt.tolist() == golden(name)["input_ids"][0, :GREEDY_PROMPT].tolist()
    clear = (fp32 == bf16) & (margin >= 0.05)
    assert clear.sum() >= 6, f"{name}: only {clear.sum()} clear steps"
    got = tp2.same_on_every_rank(f"hf_greedy/{name}")
    assert got[clear].tolist() == fp32[clear].tolist()


def test_weight_bytes_are_half(tp2):
    for name in GOLDEN_FIXTURES:
        whole = load(name)._weights.nbytes
        per_rank = [f["weight_bytes"][name] for f in tp2.facts]
        assert per_rank[0] == per_rank[1]
        # the halves plus the replicated norms and biases
        assert 0.5 <= per_rank[0] / whole < 0.56, (name, per_rank[0], whole)
        assert tp2.facts[0]["pool_blocks"][name] == tp2.facts[1]["pool_blocks"][name]


def test_fp32_logits_with_graphs_equal_eager(tp2):
    tp2.check_scenario("fp32_graphs")
    g = tp2.same_on_every_rank("fp32/graphs=True")
    assert g.dtype == np.float32
    assert np.array_equal(g, tp2.same_on_every_rank("fp32/graphs=False"))
    assert_matches_golden(g, golden("llama_gqa")["logits"][PREFIX - 1:], "fp32 TP=2")


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_tied", "qwen2"])
def test_batch_invariance_and_schedules(tp2, name):
    tp2.check_scenario("batch")
    gather = tp2.same_on_every_rank(f"batch/{name}/gather")
    assert np.array_equal(gather, tp2.same_on_every_rank(f"solo/{name}/gather")), \
        f"{name}: a row depends on its batch"
    # the all-to-all schedule adds the same partials in the same order
    assert np.array_equal(gather, tp2.same_on_every_rank(f"batch/{name}/exchange"))
    assert np.array_equal(gather, tp2.same_on_every_rank(f"solo/{name}/exchange"))
    ids = tp2.facts[0]["argmax_batch"][f"{name}/gather"]
    assert ids == tp2.facts[1]["argmax_batch"][f"{name}/gather"]
    assert ids == [int(i) for i in argmax_rule(bf16_to_f32(gather))]
    assert_matches_golden(bf16_to_f32(gather), golden(name)["logits"][[3, 11, 1, 18, 7]],
                          f"{name} decode_batch TP=2")


def test_verify_rows_equal_decode_steps(tp2):
    tp2.check_scenario("verify")
    rows = tp2.same_on_every_rank("verify/rows")
    assert np.array_equal(rows, tp2.same_on_every_rank("verify/decode"))
    assert tp2.facts[0]["verify_ids"] == tp2.facts[1]["verify_ids"]
    assert tp2.facts[0]["mixed_null"] == [False, True]
    assert_matches_golden(bf16_to_f32(tp2.same_on_every_rank("mixed/rows")),
                          golden("llama_gqa")["logits"][[16, 8]], "mixed_forward_batch TP=2")


def test_speculative_equals_greedy(tp2):
    tp2.check_scenario("spec")
    for f in tp2.facts:
        spec = f["spec"]
        for k in (1, 3, 5):
            assert spec[f"k={k}"] == spec["greedy"], f"rank {f['rank']} k={k}"
        assert spec["free"][0] == spec["free"][1]
    m = load("llama_gqa")
    want = generate(m, golden("llama_gqa")["input_ids"][0, :9].tolist(), 20,
                    stop_token_ids=[]).tokens
    assert tp2.facts[0]["spec"]["greedy"] == want


def test_scheduler_soak(tp2):
    tp2.check_scenario("soak")
    soak = [f["soak"] for f in tp2.facts]
    assert soak[0] == soak[1]
    assert soak[0]["mismatches"] == [] and soak[0]["preemptions"] > 0
    assert soak[0]["blocks_back"] and soak[0]["bytes_back"]


def test_errors_on_one_rank_are_raised_on_every_rank(tp2):
    tp2.check_scenario("failures")
    c0, c1 = (f["caught"] for f in tp2.facts)
    for key in ("bad_token_one_rank", "bad_token_all", "cache_full_one_rank",
                "different_calls", "bad_pointer_one_rank"):
        assert c0[key] is not None and c0[key] == c1[key], (key, c0[key], c1[key])
    assert c0["bad_token_one_rank"][0] == "InvalidArgument" and "999" in c0[
        "bad_token_one_rank"][1]
    assert c0["cache_full_one_rank"][0] == "CacheFull"
    assert c0["different_calls"][0] == "TensorParallelError"
    assert "different calls" in c0["different_calls"][1]
    assert c0["bad_pointer_one_rank"][0] == "InvalidArgument"
    # nothing was written by the refused calls: the sequences are as before them
    assert c0["seq_state"] == c1["seq_state"] == [0, 0, 4]
    assert tp2.facts[0]["pool_after_errors"] == tp2.facts[1]["pool_after_errors"]
    after = bf16_to_f32(tp2.same_on_every_rank("after_errors"))
    assert_matches_golden(after, golden("llama_gqa")["logits"][9], "after errors")


def test_nan_on_one_rank_raises_non_finite_logits_on_every_rank(tp2):
    """NaN weights in the last rank's vocabulary slice only (an embedding row, an lm_head
    row): the sum and the logits gather carry them to every rank, so each raises the same
    NonFiniteLogits where one device does (tests/engine/test_nonfinite.py's cases)."""
    check_nonfinite(tp2)


def check_nonfinite(res) -> None:
    res.check_scenario("nonfinite")
    f0, f1 = (f["nonfinite"] for f in res.facts)
    assert (f0["holds_nan"], f1["holds_nan"]) == (False, True)
    assert f0 == {**f1, "holds_nan": False}   # everything else alike on both ranks
    k, pos = f0["k"], len(NAN_PROMPT) + f0["k"]
    assert f0["clean"] == generate(load("llama_gqa"), NAN_PROMPT, 24, stop_token_ids=[]).tokens
    at = f"new token {k + 1} (the logits of sequence position {pos})"
    for key in ("embed_greedy", "embed_spec"):
        assert f0[key][0] == "NonFiniteLogits" and at in f0[key][1], (key, f0[key])
    assert f0["embed_seen"] == f0["clean"][:k + 1]
    assert f0["embed_sampled"][0] == "NonFiniteLogits"
    assert f"new token 0 (the logits of sequence position {len(NAN_PROMPT)})" in \
        f0["embed_sampled"][1]
    # the lm_head row: one NaN per row, from the last rank's slice of the logits
    assert f0["head_greedy"][0] == "NonFiniteLogits"
    assert "new token 0" in f0["head_greedy"][1] and "hold 1 NaN/Inf" in f0["head_greedy"][1]
    sched = f0["sched"]
    assert len(sched["errors"]) == 1 and at in sched["errors"][0]
    assert sched["reason"] == "error" and sched["output"] == f0["clean"][:k + 1]
    assert sched["good"] == sched["good_clean"]
    assert f0["blocks_back"] == [True, True]


@pytest.mark.parametrize("name", GGUF_MODELS)
def test_gguf_checkpoints(tp2, name):
    """GGUF files (dequantized to BF16 at load) split like safetensors ones: HF's logits,
    TP=1's within the BF16 tolerance, half the weights."""
    tp2.check_scenario("gguf")
    got = bf16_to_f32(tp2.same_on_every_rank(f"gguf/{name}"))
    with np.load(GGUF_FIXTURES / f"{name}.npz") as g:
        ids, want = g["input_ids"][0].tolist(), g["logits"]
    assert_matches_golden(got, want[GGUF_PREFIX - 1:GGUF_END], f"{name}.gguf TP=2")
    # TP=1 dequantized at load as the ranks are (the same logits as kept packed), its
    # weight bytes the BF16 ones the ranks split
    m = metrale.load(GGUF_FIXTURES / f"{name}.gguf", HostBackend(), progress=False,
                     gguf_dequantize=True)
    seq = m.alloc_sequence()
    one = [logits_rows(m, m.prefill(ids[:GGUF_PREFIX], seq, 0))]
    one += [logits_rows(m, m.decode(t, seq, 0)) for t in ids[GGUF_PREFIX:GGUF_END]]
    assert rel_err(got, np.concatenate(one)) < 0.02, f"{name}.gguf: TP=2 vs TP=1"
    # each rank: half the split weights plus the ones every rank holds whole: the norms,
    # and k/v_proj where there is one KV head (replicated: qwen2, qwen3 here)
    src = metrale.formats.open_source(GGUF_FIXTURES / f"{name}.gguf")
    kv_whole = m._meta.num_kv_heads % 2 != 0
    whole = sum(2 * int(np.prod(src.tensor_shape(t))) for t in src.tensor_names()
                if t.endswith("norm.weight") or (kv_whole and (".k_proj." in t or
                                                               ".v_proj." in t)))
    per_rank = [f["gguf_weight_bytes"][name] for f in tp2.facts]
    assert per_rank[0] == per_rank[1] == (m._weights.nbytes + whole) // 2, (per_rank, whole)


def test_stream_rules_hold_on_a_rank(tp2):
    """tests/model/test_pointer_streams.py's rules at TP=2, the collectives counted as
    stream work: handle 0 keeps everything on the default stream (eager and graphs); a
    decode on another stream runs its collectives there; argmax waits for that stream and
    runs on the default one; no host read races queued work."""
    tp2.check_scenario("streams")
    st = tp2.facts[0]["streams"]
    assert st == tp2.facts[1]["streams"]
    D = st["default"]
    for graphs in (False, True):
        z = st[f"zero/graphs={graphs}"]
        assert z["used"] == [D] and z["collectives"] == [D] and z["n_collectives"] > 0
        assert z["unsynced"] == []
    d = st["decode_on_s2"]
    # one decode step: the embedding's and 2 per layer reductions, the logits gather
    layers = load("llama_gqa")._meta.num_layers
    assert d["used"] == d["collectives"] == [d["s2"]] and d["n_collectives"] == 2 * layers + 2
    a = st["argmax_on_s2"]
    assert a["first"] == [["record_event", d["s2"]], ["stream_wait_event", D]]
    assert a["launch_streams"] == [D] and a["n_collectives"] == 0 and a["unsynced"] == []
    assert st["argmax_ids"][0] == st["argmax_ids"][1]


def test_communicator_protocol(tp2):
    tp2.check_scenario("comm")
    c = [f["comm"] for f in tp2.facts]
    assert c[0]["all_gather"] == c[1]["all_gather"] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert c[0]["all_to_all"] == [0, 1, 2, 100, 101, 102]
    assert c[1]["all_to_all"] == [3, 4, 5, 103, 104, 105]
    assert c[0]["all_reduce"] == c[1]["all_reduce"] == [3, 3, 3, 3]
    assert c[0]["broadcast"] == c[1]["broadcast"] == [8] * 6
    assert c[0]["exchange"] == c[1]["exchange"] == ["rank 0", "rank 1"]
    assert c[0]["graph_all_gather"] == [0, -1, -2, -3, -4, -1, -2, -3, -4, -5]
    assert "tp_sum_partials" in c[0]["bf16_all_reduce"]
    assert c[0]["nccl_unique_id"] == c[1]["nccl_unique_id"] == "AAAA"


@pytest.mark.parametrize("device_name", [pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_emu_batch_invariance(tmp_path, device_name):
    """The kernels' own sources (EmuBackend) at TP=2: rows alone equal rows in a batch under
    both schedules, and match the host twins' rows within the device tolerance."""
    proc = run_worker(tmp_path, device_name, "emu_batch")
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = Results(tmp_path, 2, proc)
    res.check_scenario("emu_batch")
    gather = res.same_on_every_rank("batch/llama_gqa/gather")
    for key in ("solo/llama_gqa/gather", "batch/llama_gqa/exchange", "solo/llama_gqa/exchange"):
        assert np.array_equal(gather, res.same_on_every_rank(key)), key
    assert_matches_golden(bf16_to_f32(gather), golden("llama_gqa")["logits"][[3, 11, 1, 18, 7]],
                          "emu decode_batch TP=2")


def test_stalled_peer_times_out(tmp_path):
    """Rank 1 stops calling: rank 0 raises TensorParallelError after its 3 s timeout and the
    job ends (MPI_Abort at exit takes rank 1 down) long before rank 1's 60 s sleep."""
    proc = run_worker(tmp_path, "cpu", "stall", timeout=120)
    assert proc.returncode != 0
    assert "STALL: rank 0 raised after" in proc.stdout, proc.stdout[-3000:]
    assert "got no answer from the other ranks within" in proc.stdout
    assert "decode returned" not in proc.stdout
    assert proc.wall_s < 45, proc.wall_s


def test_killed_peer_ends_the_job(tmp_path):
    """Rank 1 is killed: rank 0 does not decode on nor hang; mpiexec ends the job."""
    proc = run_worker(tmp_path, "cpu", "kill", timeout=120)
    assert proc.returncode != 0
    assert "decoded past a dead peer" not in proc.stdout
    assert proc.wall_s < 45, proc.wall_s


def test_bench_reports_the_all_reduce_time(tmp_path):
    """`mpiexec -n 2 metrale bench --tensor-parallel 2`: rank 0 writes the report, with each
    step's all-reduce time and bytes and the weights of one rank."""
    import json
    import subprocess
    import sys

    from tests.tp.launch import ROOT, require_mpi
    exe = require_mpi()
    out = tmp_path / "bench.json"
    proc = subprocess.run([exe, "-n", "2", sys.executable, "-m", "metrale.cli", "bench",
                           "--preset", "tiny", "--device", "cpu", "--batch", "1,3",
                           "--prompt-len", "8", "--gen-len", "3", "--tensor-parallel", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tensor parallel 2:") == 1   # rank 0 alone reports
    d = json.loads(out.read_text())
    assert d["tensor_parallel"] == 2
    hid, layers, vocab = 128, 4, 512   # the tiny preset
    for r in d["results"]:
        assert r["allreduce_ms_per_step"] > 0
        # gather schedule: (2 L + 1) reductions of n x hidden f32 from the other rank, plus
        # the other rank's half of the BF16 logits rows
        n = r["batch"]
        assert r["allreduce_bytes_per_step"] == (2 * layers + 1) * n * hid * 4 + n * vocab
    from metrale.formats import MemorySource
    from metrale.model_engine.memory_plan import weight_bytes
    whole = weight_bytes(MemorySource.preset("tiny").metadata())
    assert 0.5 <= d["weight_bytes_per_rank"] / whole < 0.52


def _cuda_gpus() -> int:
    from metrale.gpu_runtime import cuda_available
    if not cuda_available()[0]:
        return 0
    import cupy
    return int(cupy.cuda.runtime.getDeviceCount())


@pytest.mark.parametrize("device_name", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cuda_tp2_over_nccl(tmp_path, device_name):
    """Two GPUs over NCCL (needs 2 GPUs, metrale[nccl] and metrale[mpi]): goldens, batch
    invariance under both schedules with CUDA graphs, verify, errors on one rank, NaN
    weights on one rank."""
    if _cuda_gpus() < 2:
        pytest.skip("needs two GPUs")
    from metrale.gpu_runtime.comm.nccl import import_nccl
    import_nccl()
    proc = run_worker(tmp_path, device_name, "golden,batch,verify,failures,nonfinite")
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = Results(tmp_path, 2, proc)
    for sc in ("golden", "batch", "verify", "failures"):
        res.check_scenario(sc)
    check_nonfinite(res)
    for name in GOLDEN_FIXTURES:
        got = bf16_to_f32(res.same_on_every_rank(f"golden/{name}"))
        assert_matches_golden(got, golden(name)["logits"][PREFIX - 1:], f"{name} cuda TP=2")
    for name in ("llama_gqa", "llama_mqa_tied", "qwen2"):
        rows = res.same_on_every_rank(f"batch/{name}/gather")
        for key in (f"solo/{name}/gather", f"batch/{name}/exchange", f"solo/{name}/exchange"):
            assert np.array_equal(rows, res.same_on_every_rank(key)), key
    assert np.array_equal(res.same_on_every_rank("verify/rows"),
                          res.same_on_every_rank("verify/decode"))
    c0, c1 = (f["caught"] for f in res.facts)
    assert c0 == c1 and c0["cache_full_one_rank"][0] == "CacheFull"
