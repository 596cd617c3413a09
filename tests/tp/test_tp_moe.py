"""Tensor parallelism over mixture-of-experts checkpoints (issue 41), TP=2 under mpiexec on
the CPU: every expert's intermediate dimension split (tp/moe_shard.py), the router whole,
the ranks' FP32 combines summed in rank order. Checked on qwen3_moe, qwen2_moe (shared
expert), mixtral and quantized Qwen3-MoE (FP8 block, GPTQ act-order: experts cut packed): every rank the same rows; the golden within the BF16 bound; TP=2
within the BF16 tolerance of TP=1; decode_batch rows equal solo steps bit for bit; each
rank holds about 1/2 of the weights (the router, norms and the shared expert's gate whole)."""
import numpy as np
import pytest

from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import emu_available
from tests.model.common import assert_matches_golden, golden, load, logits_rows, rel_err
from tests.tp.launch import Results, run_worker
from tests.tp.worker_moe import MOE_PREFIX, MOE_TP_FIXTURES, QUANT_MOE_TP


@pytest.fixture(scope="module")
def tp2m(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2m")
    proc = run_worker(out, "cpu", "moe", timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


@pytest.mark.parametrize("name", MOE_TP_FIXTURES + QUANT_MOE_TP[2])
def test_moe_goldens_tp1_batch_and_rank_bytes(tp2m, name):
    tp2m.check_scenario("moe")
    got = bf16_to_f32(tp2m.same_on_every_rank(f"moe/{name}"))
    g = golden(name)
    assert_matches_golden(got, g["logits"][MOE_PREFIX - 1:], f"{name} TP=2")
    m = load(name)
    ids = g["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    one = [logits_rows(m, m.prefill(ids[:MOE_PREFIX], seq, 0))]
    one += [logits_rows(m, m.decode(t, seq, 0)) for t in ids[MOE_PREFIX:]]
    assert rel_err(got, np.concatenate(one)) < 0.02, f"{name}: TP=2 vs TP=1"
    assert np.array_equal(tp2m.same_on_every_rank(f"moe_batch/{name}"),
                          tp2m.same_on_every_rank(f"moe_solo/{name}"))
    whole = m._weights.nbytes
    per_rank = [f["moe_weight_bytes"][name] for f in tp2m.facts]
    # + the replicated parts: routers, norms; FP8 scale rows a block boundary shares; a
    # quantized column slice's rows padded to the kernels' 32-code pitch (FP8 down: 72
    # codes in 96 bytes); act-order tables (4 bytes an input column) and the scales /
    # zeros of every group a column slice uses (a shuffled g_idx: all of them)
    bound = {"q_moe_gptq_actorder": 0.60, "q_moe_fp8_block": 0.55}.get(name, 0.53)
    assert all(b <= bound * whole for b in per_rank), (name, per_rank, whole)
    print(f"{name}: TP=1 {whole} bytes, TP=2 per rank {per_rank}")


def test_moe_tp2_with_decode_graphs_gives_the_eager_bits(tp2m):
    """qwen2_moe with decode graphs captured: the replayed MoE layers (each rank's combine
    and the rank-order sum) give the eager rows' bits."""
    tp2m.check_scenario("moe")
    assert np.array_equal(tp2m.same_on_every_rank("moe_graphs/qwen2_moe"),
                          tp2m.same_on_every_rank("moe/qwen2_moe"))
    assert all(f["moe_graphs_captured"] > 0 for f in tp2m.facts)


@pytest.mark.parametrize("device_name", [pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_moe_tp2_on_the_emulator(tmp_path, tp2m, device_name):
    """The same scenario on the kernels' own sources: every rank the same rows, within the
    BF16 tolerance of the HostBackend run and of the golden, decode_batch = solo."""
    proc = run_worker(tmp_path, device_name, "moe", timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    emu = Results(tmp_path, 2, proc)
    emu.check_scenario("moe")
    for name in MOE_TP_FIXTURES + QUANT_MOE_TP[2]:
        got = bf16_to_f32(emu.same_on_every_rank(f"moe/{name}"))
        assert rel_err(got, bf16_to_f32(tp2m.same_on_every_rank(f"moe/{name}"))) < 0.02
        assert_matches_golden(got, golden(name)["logits"][MOE_PREFIX - 1:], f"{name} emu")
        assert np.array_equal(emu.same_on_every_rank(f"moe_batch/{name}"),
                              emu.same_on_every_rank(f"moe_solo/{name}"))
