"""TP=4 under `mpiexec -n 4` on the CPU (issue 41): the quantized (per-channel FP8, GPTQ
act-order) and mixture-of-experts (qwen3_moe, qwen2_moe, mixtral: KV heads replicated over
two ranks each) scenarios of tests/tp/worker.py. Every rank the same rows, the golden
within the BF16 bound, decode_batch rows equal solo steps, each rank about 1/4 of the
weights plus what every rank keeps whole."""
import numpy as np
import pytest

from metrale.ops.bf16 import bf16_to_f32
from tests.model.common import assert_matches_golden, golden, load
from tests.tp.launch import Results, run_worker
from tests.tp.worker_moe import MOE_PREFIX, MOE_TP_FIXTURES, QUANT_MOE_TP
from tests.tp.worker_quant import QUANT_PREFIX, QUANT_TP4_FIXTURES


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp4")
    proc = run_worker(out, "cpu", "quant,moe", ranks=4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 4, proc)


@pytest.mark.parametrize("name", QUANT_TP4_FIXTURES + MOE_TP_FIXTURES + QUANT_MOE_TP[4])
def test_tp4_goldens_and_rank_bytes(tp4, name):
    moe = name in MOE_TP_FIXTURES + QUANT_MOE_TP[4]
    tp4.check_scenario("moe" if moe else "quant")
    key, prefix = ("moe", MOE_PREFIX) if moe else ("quant", QUANT_PREFIX)
    got = bf16_to_f32(tp4.same_on_every_rank(f"{key}/{name}"))
    assert_matches_golden(got, golden(name)["logits"][prefix - 1:], f"{name} TP=4")
    if moe:
        assert np.array_equal(tp4.same_on_every_rank(f"moe_batch/{name}"),
                              tp4.same_on_every_rank(f"moe_solo/{name}"))
    whole = load(name)._weights.nbytes
    per_rank = [f[f"{key}_weight_bytes"][name] for f in tp4.facts]
    # 1/4 plus the replicated parts: norms, routers, the KV heads two ranks share, act-order
    # tables and the groups a column slice uses
    assert all(b <= 0.36 * whole for b in per_rank), (name, per_rank, whole)
    print(f"{name}: TP=1 {whole} bytes, TP=4 per rank {per_rank}")


def test_tp4_quantized_decode_batch_rows_equal_solo_steps(tp4):
    assert np.array_equal(tp4.same_on_every_rank("quant_batch"),
                          tp4.same_on_every_rank("quant_solo"))
