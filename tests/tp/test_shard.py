"""Tensor parallelism in one process: launcher ranks, the shard plan and its refusals, the
sharded weights against slices of the checkpoint, the agreement rules over a scripted
communicator, and what `metrale.load` refuses before any rank talks to another."""
from dataclasses import replace

import numpy as np
import pytest

import metrale
from metrale import InvalidArgument, TensorParallelError, Unsupported
from metrale.formats import open_source
from metrale.gpu_runtime import HostBackend
from metrale.gpu_runtime.comm.communicator import (EXCHANGE_BYTES, Deadline, check_collective, pack_payload,
                                      unpack_payloads)
from metrale.gpu_runtime.comm.ranks import RankInfo, launcher_ranks
from metrale.model_engine.agreement import (call_digest, error_record, ok_record, settle)
from metrale.model_engine.tp.shard import plan_shards, rank_weight_bytes
from metrale.model_engine.tp.sharded_weights import ShardedDecoderWeights
from tests.model.common import FIXTURES

META = open_source(FIXTURES / "llama_gqa").metadata()   # H 4, KV 2, I 128, hidden 64, V 256


# launcher ranks -------------------------------------------------------------------------------
@pytest.mark.parametrize("env,want", [
    ({}, RankInfo(0, 1, 0, "single")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, RankInfo(3, 8, 3, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, RankInfo(5, 8, 1, "openmpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, RankInfo(1, 2, 1, "mpich")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, RankInfo(1, 2, 0, "mpich")),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2"},
     RankInfo(2, 4, 2, "slurm")),
])
def test_launcher_ranks(env, want):
    assert launcher_ranks(env) == want
    assert want.is_mpi == (want.launcher in ("openmpi", "mpich", "slurm"))


@pytest.mark.parametrize("env,match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "is not a rank"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "is not a rank"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "not a local rank"),
])
def test_launcher_ranks_malformed(env, match):
    with pytest.raises(TensorParallelError, match=match):
        launcher_ranks(env)


# the shard plan -------------------------------------------------------------------------------
def test_plan_splits_heads_intermediate_vocabulary():
    plans = [plan_shards(META, r, 2, "m") for r in range(2)]
    assert [(p.head_start, p.num_heads) for p in plans] == [(0, 2), (2, 2)]
    assert [(p.kv_head_start, p.num_kv_heads, p.kv_replicated) for p in plans] == \
        [(0, 1, False), (1, 1, False)]
    assert [(p.inter_start, p.intermediate) for p in plans] == [(0, 64), (64, 64)]
    assert [(p.vocab_start, p.vocab_shard, p.vocab_rows) for p in plans] == \
        [(0, 128, 128), (128, 128, 128)]
    lm = plans[1].layer_metadata(META)
    assert (lm.num_heads, lm.num_kv_heads, lm.intermediate_size, lm.vocab_size) == \
        (2, 1, 64, 256)


def test_plan_replicates_kv_heads_when_ranks_exceed_them():
    meta = replace(META, num_heads=8, num_kv_heads=2, hidden_size=64)
    plans = [plan_shards(meta, r, 4, "m") for r in range(4)]
    # query heads 0-1 and 2-3 use KV head 0, 4-5 and 6-7 KV head 1 (group of 4)
    assert [p.kv_head_start for p in plans] == [0, 0, 1, 1]
    assert all(p.num_kv_heads == 1 and p.kv_replicated for p in plans)
    for p in plans:
        group = meta.num_heads // meta.num_kv_heads
        assert {h // group for h in range(p.head_start, p.head_start + p.num_heads)} == \
            {p.kv_head_start}


def test_plan_pads_the_last_vocabulary_slice():
    meta = replace(META, vocab_size=250)
    p = [plan_shards(meta, r, 4, "m") for r in range(4)]
    assert [(x.vocab_start, x.vocab_shard, x.vocab_rows) for x in p] == \
        [(0, 63, 63), (63, 63, 63), (126, 63, 63), (189, 63, 61)]


@pytest.mark.parametrize("changes,n,field", [
    (dict(num_heads=6, num_kv_heads=2), 4, "num_attention_heads=6"),
    (dict(intermediate_size=130), 4, "intermediate_size=130"),
    (dict(hidden_size=66, num_heads=4), 4, "hidden_size=66"),
    (dict(num_heads=12, num_kv_heads=3), 4, "num_key_value_heads=3"),
    (dict(num_heads=12, num_kv_heads=6), 4, "num_key_value_heads=6"),
])
def test_plan_refusals_name_the_field(changes, n, field):
    with pytest.raises(Unsupported, match=f"tensor_parallel_size={n} .*{field}"):
        plan_shards(replace(META, **changes), 0, n, "m")
    with pytest.raises(Unsupported, match="outside"):
        plan_shards(META, 0, 65, "m")


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_tied", "qwen2", "qwen3",
                                  "llama_mlp_bias", "llama_attention_bias",
                                  "llama_tied_stored_head"])
def test_sharded_weights_are_the_checkpoint_slices(name):
    src = open_source(FIXTURES / name)
    meta = src.metadata()
    be = HostBackend()
    N = 2
    D, hid = meta.head_dim, meta.hidden_size
    for rank in range(N):
        plan = plan_shards(meta, rank, N, name)
        w = ShardedDecoderWeights(be, src, meta, plan, progress=False)

        def dev(ptr, shape):
            out = np.empty(shape, np.uint16)
            be.copy_d2h(ptr, out)
            return out
        L = w.layers[1]
        q = src.read_bf16("model.layers.1.self_attn.q_proj.weight")
        k = src.read_bf16("model.layers.1.self_attn.k_proj.weight")
        v = src.read_bf16("model.layers.1.self_attn.v_proj.weight")
        qs = slice(plan.head_start * D, (plan.head_start + plan.num_heads) * D)
        ks = slice(plan.kv_head_start * D, (plan.kv_head_start + plan.num_kv_heads) * D)
        rows = (plan.num_heads + 2 * plan.num_kv_heads) * D
        assert np.array_equal(dev(L.qkv, (rows, hid)), np.concatenate([q[qs], k[ks], v[ks]]))
        o = src.read_bf16("model.layers.1.self_attn.o_proj.weight")
        assert np.array_equal(dev(L.o_proj, (hid, plan.num_heads * D)), o[:, qs])
        i = slice(plan.inter_start, plan.inter_start + plan.intermediate)
        down = src.read_bf16("model.layers.1.mlp.down_proj.weight")
        assert np.array_equal(dev(L.down_proj, (hid, plan.intermediate)), down[:, i])
        gate = src.read_bf16("model.layers.1.mlp.gate_proj.weight")
        up = src.read_bf16("model.layers.1.mlp.up_proj.weight")
        assert np.array_equal(dev(L.gate_up, (2 * plan.intermediate, hid)),
                              np.concatenate([gate[i], up[i]]))
        if meta.mlp_bias:   # down's bias whole (added once, after the sum)
            assert np.array_equal(dev(L.down_bias, (hid,)),
                                  src.read_bf16("model.layers.1.mlp.down_proj.bias"))
        emb = src.read_bf16("model.embed_tokens.weight")
        vs = slice(plan.vocab_start, plan.vocab_start + plan.vocab_rows)
        assert np.array_equal(dev(w.embed_tokens, (plan.vocab_shard, hid))[:plan.vocab_rows],
                              emb[vs])
        tied = "lm_head.weight" not in src.tensor_names()
        assert (w.lm_head == w.embed_tokens) == tied
        assert w.nbytes == rank_weight_bytes(meta, plan, tied)
        assert be.live_bytes() == w.nbytes   # the estimate is what was allocated
        w.free()
        assert be.live_bytes() == 0


def test_a_bad_checkpoint_fails_before_any_upload(tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_gqa", d)
    cfg = (d / "config.json").read_text().replace('"intermediate_size": 128',
                                                  '"intermediate_size": 192')
    (d / "config.json").write_text(cfg)
    src = open_source(d)
    be = HostBackend()
    with pytest.raises(metrale.FormatError, match="gate_proj"):
        ShardedDecoderWeights(be, src, src.metadata(), plan_shards(src.metadata(), 0, 2, "m"),
                              progress=False)
    assert be.live_bytes() == 0


# the agreement, over a scripted communicator ------------------------------------------------
class Scripted:
    """A communicator whose exchange answers with the other ranks' scripted records."""

    def __init__(self, rank: int, others: dict) -> None:
        self.rank, self.others = rank, others
        self.sent = []

    def exchange(self, record: bytes):
        self.sent.append(record)
        return [record if r == self.rank else self.others[r] for r in range(1 + len(self.others))]


def test_settle_all_fine_returns_the_records():
    d = bytes(range(16))
    comm = Scripted(0, {1: ok_record(d, "x")})
    assert len(settle(comm, ok_record(d, "x"), None)) == 2


def test_settle_raises_the_first_failing_ranks_error():
    d = bytes(16)
    comm = Scripted(0, {1: error_record(metrale.CacheFull("KV cache exhausted: 3 free")),
                        2: error_record(InvalidArgument("token 9 bad"))})
    with pytest.raises(metrale.CacheFull, match="^KV cache exhausted: 3 free$") as e:
        settle(comm, ok_record(d, "decode"), None)
    assert e.value.tp_agreed
    # the failing rank itself: its own exception is the one re-raised (settle returns)
    own = InvalidArgument("mine")
    comm = Scripted(1, {0: ok_record(d, "x")})
    assert settle(comm, error_record(own), own)
    # another rank failed first: its error, chained to this rank's own
    comm = Scripted(1, {0: error_record(InvalidArgument("rank 0's"))})
    with pytest.raises(InvalidArgument, match="rank 0's") as e:
        settle(comm, error_record(own), own)
    assert e.value.__cause__ is own


def test_settle_foreign_exceptions_become_tensor_parallel_errors():
    comm = Scripted(0, {1: error_record(KeyError("k"))})
    with pytest.raises(TensorParallelError, match="rank 1 raised KeyError"):
        settle(comm, ok_record(bytes(16), "x"), None)


def test_settle_different_calls():
    comm = Scripted(0, {1: ok_record(b"b" * 16, "prefill(...)")})
    with pytest.raises(TensorParallelError, match=r"rank 0: decode.*rank 1: prefill"):
        settle(comm, ok_record(b"a" * 16, "decode(...)"), None)


def test_settle_at_load_names_the_failing_rank():
    """Loading (name_rank): the other ranks' error names the failing rank; a rank that
    failed the same way re-raises its own."""
    bad = metrale.FormatError("r1/config.json: not valid JSON")
    comm = Scripted(0, {1: error_record(bad)})
    with pytest.raises(metrale.FormatError, match=r"^tensor parallel: rank 1 of 2 failed: "
                                                  r"r1/config.json: not valid JSON$"):
        settle(comm, ok_record(bytes(16), "x"), None, name_rank=True)
    comm = Scripted(0, {1: error_record(OSError("disk"))})
    with pytest.raises(TensorParallelError, match=r"^tensor parallel: rank 1 of 2 failed: "
                                                  r"OSError: disk$"):
        settle(comm, ok_record(bytes(16), "x"), None, name_rank=True)
    same = metrale.FormatError("x: not valid JSON")
    comm = Scripted(1, {0: error_record(metrale.FormatError("x: not valid JSON"))})
    assert settle(comm, error_record(same), same, name_rank=True)


def test_call_digest_ignores_pointers_and_streams_but_not_tokens():
    m = metrale.load(FIXTURES / "llama_gqa", HostBackend(), progress=False)
    seq = m.alloc_sequence()
    a = call_digest("decode", {"token": 5, "seq": seq, "stream": 0}, m)
    assert a == call_digest("decode", {"token": 5, "seq": seq, "stream": 12345}, m)
    assert a[0] != call_digest("decode", {"token": 6, "seq": seq, "stream": 0}, m)[0]
    p = call_digest("argmax_on_device", {"logits_ptr": m.logits_buffer_ptr(), "stream": 0}, m)
    assert p == call_digest("argmax_on_device", {"logits_ptr": 1 << 40, "stream": 0}, m)
    toks = call_digest("prefill", {"tokens": np.array([1, 2], np.int32), "seq": seq}, m)
    assert toks[0] != call_digest("prefill", {"tokens": [1, 3], "seq": seq}, m)[0]
    assert toks[0] == call_digest("prefill", {"tokens": [1, 2], "seq": seq}, m)[0]
    out = np.zeros(4, np.uint16)   # an output buffer's contents are not the call
    assert call_digest("copy_logits_to_host", {"logits_ptr": 1, "dst": out}, m) == \
        call_digest("copy_logits_to_host", {"logits_ptr": 1, "dst": out + 7}, m)
    assert "pool" in a[1]


# the communicator's host helpers ------------------------------------------------------------
def test_payloads_round_trip_and_refuse_oversize():
    bufs = np.stack([pack_payload(b"abc"), pack_payload(b""), pack_payload(b"x" * 1000)])
    assert unpack_payloads(bufs) == [b"abc", b"", b"x" * 1000]
    with pytest.raises(InvalidArgument, match="exceeds"):
        pack_payload(b"x" * EXCHANGE_BYTES)


def test_collective_checks():
    assert check_collective("all_gather", 4, np.uint16) == np.uint16
    with pytest.raises(InvalidArgument, match="dtype float64"):
        check_collective("all_gather", 4, np.float64)
    with pytest.raises(InvalidArgument, match="BF16 sums"):
        check_collective("all_reduce", 4, np.uint16, reduce=True)
    with pytest.raises(InvalidArgument, match="count"):
        check_collective("all_gather", 0, np.float32)


def test_deadline_calls_the_timeout():
    hits = []

    def on_timeout(waited):
        hits.append(waited)
        raise TensorParallelError("late")
    with pytest.raises(TensorParallelError, match="late"):
        Deadline(0.05).wait(lambda: False, on_timeout)
    assert hits and hits[0] >= 0.05
    Deadline(0.05).wait(lambda: True, on_timeout)


# refusals of metrale.load --------------------------------------------------------------------
def test_load_refuses_a_size_the_launcher_did_not_start(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2 but this process is "
                                                  r"rank 0 of 1 .*mpiexec -n 2"):
        metrale.load(FIXTURES / "llama_gqa", "cpu", tensor_parallel_size=2, progress=False)
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(InvalidArgument, match="tensor_parallel_size"):
            metrale.load(FIXTURES / "llama_gqa", "cpu", tensor_parallel_size=bad)


@pytest.mark.parametrize("argv,orig,want", [
    (["/v/bin/metrale", "bench", "preset:tiny", "--tensor-parallel", "2"],
     ["/v/bin/python3", "/v/bin/metrale", "bench", "preset:tiny", "--tensor-parallel", "2"],
     "mpiexec -n 2 metrale bench preset:tiny --tensor-parallel 2 or torchrun "
     "--nproc-per-node 2 --no-python metrale bench preset:tiny --tensor-parallel 2"),
    (["/w/metrale/cli/__main__.py", "bench", "a b"], ["python", "-u", "-m", "metrale.cli",
                                                     "bench", "a b"],
     "mpiexec -n 2 python -m metrale.cli bench 'a b' or torchrun --nproc-per-node 2 "
     "-m metrale.cli bench 'a b'"),
    (["run.py", "-m", "x"], ["py3", "run.py", "-m", "x"],
     "mpiexec -n 2 py3 run.py -m x or torchrun --nproc-per-node 2 run.py -m x"),
    (["-c"], ["python", "-c", "import metrale"],
     "mpiexec -n 2 python YOUR_SCRIPT.py or torchrun --nproc-per-node 2 YOUR_SCRIPT.py"),
    ([""], ["python"],
     "mpiexec -n 2 python YOUR_SCRIPT.py or torchrun --nproc-per-node 2 YOUR_SCRIPT.py")])
def test_launch_hint_repeats_the_command_that_was_run(argv, orig, want):
    from metrale.gpu_runtime.comm.ranks import launch_hint
    assert launch_hint(2, argv, orig) == want


def test_the_size_refusal_suggests_the_command_the_user_ran(tmp_path):
    """Without a launcher: `metrale bench ... --tensor-parallel 2` is told to run that
    `metrale` command under mpiexec (not `python ...`), a script the script."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from tests.tp.launch import ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("PMI_", "OMPI_", "SLURM_", "MPI_")) and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    exe = Path(sys.executable).parent / "metrale"
    if not exe.exists():
        pytest.skip("no metrale console script next to the interpreter")
    args = ["bench", "preset:tiny", "--device", "cpu", "--batch", "1", "--prompt-len", "4",
            "--gen-len", "2", "--tensor-parallel", "2"]
    proc = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"e.g. mpiexec -n 2 metrale {' '.join(args)} or torchrun" in proc.stderr
    script = tmp_path / "run.py"
    script.write_text("import sys, metrale\n"
                      f"metrale.load({str(FIXTURES / 'llama_gqa')!r}, 'cpu', "
                      "tensor_parallel_size=2)\n")
    proc = subprocess.run([sys.executable, "run.py", "--flag"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert f"e.g. mpiexec -n 2 {sys.executable} run.py --flag or torchrun --nproc-per-node 2 " \
           "run.py --flag" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name,arch", [("whisper_tiny", "whisper"), ("llava_tiny", "llava")])
def test_whisper_and_llava_stay_on_one_device(name, arch):
    with pytest.raises(Unsupported, match=f"tensor_parallel_size=2: {arch} runs on one device"):
        metrale.load(FIXTURES / name, "cpu", tensor_parallel_size=2)


def test_gpt_oss_stays_on_one_device():
    with pytest.raises(Unsupported, match="tensor_parallel_size=2: gpt_oss runs on one device"):
        metrale.load(FIXTURES / "gpt_oss", "cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("name,match", [
    ("q_gptq_v1", "tensor model.layers.0.mlp.down_proj: a rank's input columns \\[0, 96\\) "
                  "cut a 4-bit group \\(group_size 64\\)"),
    ("q_fp8_head", "tensor model.layers.0.mlp.down_proj: a rank's input columns start at 100, "
                   "inside an FP8 scale block of 32 columns")])
def test_quantized_splits_the_format_cannot_hold_are_refused_by_name(name, match):
    """Quantized checkpoints are split packed (tp/quant_shard.py); only a split that cuts a
    4-bit group, or starts an FP8 block slice off the 8-column grid, is refused: by name,
    before the metadata reaches a launcher."""
    with pytest.raises(Unsupported, match="tensor_parallel_size=2: " + match):
        metrale.load(FIXTURES / name, "cpu", tensor_parallel_size=2)


def test_quantized_experts_that_cut_a_group_are_refused_by_name():
    """Experts are split packed (tp/moe_shard.py); q_moe_awq's groups of 32 do not divide
    the 48 expert columns a rank's down slice holds."""
    with pytest.raises(Unsupported, match="tensor_parallel_size=2: tensor model.layers.0.mlp."
                                          "experts.0.down_proj: a rank's input columns "
                                          "\\[0, 48\\) cut a 4-bit group \\(group_size 32\\)"):
        metrale.load(FIXTURES / "q_moe_awq", "cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("name", ["q_moe_awq", "q_moe_gptq_actorder", "q_moe_fp8_block"])
def test_expert_parallel_keeps_quantized_experts_whole_and_packed(name):
    """Under expert_parallel=True no expert is cut: q_moe_awq (whose down slices TP inside
    the experts refuses) passes the row-parallel check, and each rank holds its experts
    packed (QuantExperts of the whole widths), their bytes adding up to one process's."""
    from metrale.model_engine.moe_quant import QuantExperts
    from metrale.model_engine.tp.model import refuse_unsharded
    src = open_source(FIXTURES / name)
    refuse_unsharded(src, 2, expert_parallel=True)
    meta = src.metadata()
    one = metrale.load(FIXTURES / name, HostBackend(), progress=False)
    want = sum(L.moe.gate_up.nbytes + L.moe.down.nbytes for L in one._weights.layers)
    one.teardown()
    got = 0
    for rank in range(2):
        plan = plan_shards(meta, rank, 2, name, expert_parallel=True)
        w = ShardedDecoderWeights(HostBackend(), src, meta, plan, progress=False)
        for L in w.layers:
            assert isinstance(L.moe.gate_up, QuantExperts) and isinstance(L.moe.down,
                                                                          QuantExperts)
            assert (L.moe.down.n, L.moe.down.k) == (meta.hidden_size,
                                                    meta.moe.expert_intermediate_size)
            got += L.moe.gate_up.nbytes + L.moe.down.nbytes
        w.free()
    assert got == want, (got, want)


def test_an_expert_width_the_ranks_cannot_split_is_refused_by_name():
    meta = open_source(FIXTURES / "qwen2_moe").metadata()   # experts 48, shared 80 wide
    plan_shards(meta, 0, 4, "x")
    odd = replace(meta, moe=replace(meta.moe, expert_intermediate_size=50))
    with pytest.raises(Unsupported, match="tensor_parallel_size=4 does not divide "
                                          "moe_intermediate_size=50"):
        plan_shards(odd, 0, 4, "x")
    odd = replace(meta, moe=replace(meta.moe, shared_expert_intermediate_size=90))
    with pytest.raises(Unsupported, match="does not divide shared_expert_intermediate_size=90"):
        plan_shards(odd, 0, 4, "x")


def test_moe_plan_splits_every_expert_and_the_shared_one():
    meta = open_source(FIXTURES / "qwen2_moe").metadata()
    p = plan_shards(meta, 1, 2, "x")
    lm = p.layer_metadata(meta)
    assert (p.expert_start, p.expert_intermediate, p.shared_start, p.shared_intermediate) == \
        (24, 24, 40, 40)
    assert lm.moe.expert_intermediate_size == 24 and lm.moe.shared_expert_intermediate_size == 40


@pytest.mark.parametrize("name,field,n", [("qwen3_moe", "moe_intermediate_size=48", 5),
                                          ("qwen2_moe", "shared_expert_intermediate_size=80", 3),
                                          ("mixtral", "num_experts=4", 8)])
def test_an_expert_split_that_does_not_divide_is_refused(name, field, n):
    """Planned before any rank talks to another: an intermediate width N does not divide
    (tensor parallel), fewer experts than ranks (expert parallel)."""
    from metrale.formats import open_source
    from metrale.model_engine.tp.shard import plan_shards
    meta = open_source(FIXTURES / name).metadata()
    meta = replace(meta, num_heads=120, num_kv_heads=120, hidden_size=960,
                   intermediate_size=1200)
    with pytest.raises(Unsupported, match=field):
        plan_shards(meta, 0, n, "x", expert_parallel=field.startswith("num_experts"))


def test_the_tensor_contract_is_refused():
    with pytest.raises(Unsupported, match="pointer API"):
        metrale.load_generative(FIXTURES / "llama_gqa", "cpu", tensor_parallel_size=2)


def test_host_ranks_need_an_mpi_launcher():
    from metrale.gpu_runtime.comm import open_communicator
    with pytest.raises(Unsupported, match="mpiexec"):
        open_communicator(HostBackend(), RankInfo(0, 2, 0, "torchrun"))


def test_expert_parallel_needs_ranks_and_experts():
    """expert_parallel=True without tensor_parallel_size, or on a dense checkpoint, is refused
    by name before any rank is asked for."""
    with pytest.raises(InvalidArgument, match="expert_parallel=True .* tensor_parallel_size"):
        metrale.load(FIXTURES / "mixtral", "cpu", expert_parallel=True)
    meta = open_source(FIXTURES / "llama_gqa").metadata()
    with pytest.raises(Unsupported, match="expert_parallel=True needs a mixture-of-experts"):
        plan_shards(meta, 0, 2, "x", expert_parallel=True)
    with pytest.raises(InvalidArgument, match="expert_parallel must be a bool"):
        metrale.load(FIXTURES / "mixtral", "cpu", tensor_parallel_size=2, expert_parallel=1)


def test_expert_plans_split_the_bytes():
    """Tensor parallel: every expert's 1/N; expert parallel: E // N or E // N + 1 experts."""
    meta = open_source(FIXTURES / "qwen2_moe").metadata()
    tp = [plan_shards(meta, r, 2, "x") for r in range(2)]
    assert [(p.expert_start, p.expert_intermediate, p.local_experts) for p in tp] == \
        [(0, 24, 6), (24, 24, 6)]
    assert [(p.shared_start, p.shared_intermediate) for p in tp] == [(0, 40), (40, 40)]
    ep = [plan_shards(meta, r, 4, "x", expert_parallel=True) for r in range(4)]
    assert [(p.first_expert, p.local_experts, p.expert_intermediate) for p in ep] == \
        [(0, 1, 48), (1, 2, 48), (3, 1, 48), (4, 2, 48)]
    assert rank_weight_bytes(meta, tp[0], True) == rank_weight_bytes(meta, tp[1], True)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("ep", [False, True])
def test_a_rank_holds_its_expert_slices_and_the_bytes_it_declares(name, ep):
    """Each rank's expert gate|up rows and down columns (TP) or whole experts (EP), the
    router and shared expert whole; the device bytes held are exactly `nbytes` (the memory
    plan's and weight_bytes()'s figure), and the ranks' expert bytes add up to the model's."""
    src = open_source(FIXTURES / name)
    meta = src.metadata()
    moe = meta.moe
    gate, upn, down = moe.expert_proj
    b = f"model.layers.1.{moe.block}."
    expert_bytes = 0
    for rank in range(2):
        be = HostBackend()
        plan = plan_shards(meta, rank, 2, name, expert_parallel=ep)
        w = ShardedDecoderWeights(be, src, meta, plan, progress=False)
        assert be.live_bytes() == w.nbytes
        L = w.layers[1].moe
        i, i0, hid = plan.expert_intermediate, plan.expert_start, meta.hidden_size
        El = plan.local_experts
        gu = np.empty((El, 2 * i, hid), np.uint16)
        be.copy_d2h(L.gate_up, gu)
        dn = np.empty((El, hid, i), np.uint16)
        be.copy_d2h(L.down, dn)
        for j in range(El):
            e = plan.first_expert + j
            x = f"{b}experts.{e}."
            assert np.array_equal(gu[j, :i], src.read_bf16(x + gate + ".weight")[i0:i0 + i])
            assert np.array_equal(gu[j, i:], src.read_bf16(x + upn + ".weight")[i0:i0 + i])
            assert np.array_equal(dn[j], src.read_bf16(x + down + ".weight")[:, i0:i0 + i])
        router = np.empty((moe.num_experts, hid), np.uint16)
        be.copy_d2h(L.router, router)
        assert np.array_equal(router, src.read_bf16(b + "gate.weight"))
        if moe.shared_expert_intermediate_size:   # TP: a slice of it; EP: whole
            s0, S = plan.shared_start, plan.shared_intermediate
            assert S == moe.shared_expert_intermediate_size // (1 if ep else 2)
            sd = np.empty((hid, S), np.uint16)
            be.copy_d2h(L.shared_down, sd)
            assert np.array_equal(sd, src.read_bf16(b + "shared_expert.down_proj.weight")[
                :, s0:s0 + S])
            sgu = np.empty((2 * S, hid), np.uint16)
            be.copy_d2h(L.shared_gate_up, sgu)
            assert np.array_equal(sgu[S:], src.read_bf16(b + "shared_expert.up_proj.weight")[
                s0:s0 + S])
        expert_bytes += gu.nbytes + dn.nbytes
        w.free()
        assert be.live_bytes() == 0
    assert expert_bytes == moe.num_experts * 3 * moe.expert_intermediate_size * \
        meta.hidden_size * 2


def test_bench_leaves_out_the_reduction_columns_under_expert_parallelism():
    """`metrale bench --tensor-parallel N ` on an expert-parallel model: the all-reduce
    columns time and count reductions only, so they are left out rather than wrong."""
    from types import SimpleNamespace
    from metrale.bench.tensor_parallel import comm_columns
    model = SimpleNamespace(_tp=SimpleNamespace(ep=object()))
    assert comm_columns(model, 0, 4) == {}
