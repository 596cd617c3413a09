"""Tensor parallelism over quantized checkpoints (issue 41), TP=2 under mpiexec on the CPU:
FP8 block-scaled (a shard boundary inside a 128 x 128 block, rows and columns), per-channel
compressed-tensors FP8, GPTQ with act-order and AWQ, each split packed. Checked: every rank
gets the same rows; the golden within the BF16 bound; TP=2 within the BF16 tolerance of
TP=1; decode_batch rows equal solo steps; each rank holds about 1/2 of the quantized bytes
(the replicated norms aside)."""
import pytest

from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import emu_available
from tests.model.common import assert_matches_golden, golden, load, rel_err
from tests.model.common import logits_rows
from tests.tp.launch import Results, run_worker
from tests.tp.worker_quant import QUANT_PREFIX, QUANT_TP_FIXTURES

import numpy as np


@pytest.fixture(scope="module")
def tp2q(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2q")
    proc = run_worker(out, "cpu", "quant", timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


def tp1_rows(name: str) -> np.ndarray:
    m = load(name)
    ids = golden(name)["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:QUANT_PREFIX], seq, 0))]
    rows += [logits_rows(m, m.decode(t, seq, 0)) for t in ids[QUANT_PREFIX:]]
    return np.concatenate(rows), m._weights.nbytes


@pytest.mark.parametrize("name", QUANT_TP_FIXTURES)
def test_quantized_goldens_tp1_and_rank_bytes(tp2q, name):
    tp2q.check_scenario("quant")
    got = bf16_to_f32(tp2q.same_on_every_rank(f"quant/{name}"))
    g = golden(name)
    assert_matches_golden(got, g["logits"][QUANT_PREFIX - 1:], f"{name} TP=2")
    one, whole = tp1_rows(name)
    assert rel_err(got, one) < 0.02, f"{name}: TP=2 vs TP=1"
    per_rank = [f["quant_weight_bytes"][name] for f in tp2q.facts]
    # 1/2 of the whole plus what every rank keeps whole: norms, FP8 scale rows a block
    # boundary shares; with act-order the g_idx tables (4 bytes an input column a part) and
    # the scales / zeros of every group a column slice uses (a shuffled g_idx: all of them)
    bound = 0.56 if name == "q_gptq_v2_actorder" else 0.53
    assert all(b <= bound * whole for b in per_rank), (name, per_rank, whole)
    print(f"{name}: TP=1 {whole} bytes, TP=2 per rank {per_rank}")


def test_quantized_decode_batch_rows_equal_solo_steps(tp2q):
    tp2q.check_scenario("quant")
    assert np.array_equal(tp2q.same_on_every_rank("quant_batch"),
                          tp2q.same_on_every_rank("quant_solo"))


@pytest.mark.parametrize("device_name", [pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_quantized_tp2_on_the_emulator_equals_the_cpu_run_within_tolerance(tmp_path, tp2q,
                                                                           device_name):
    """The same scenario with the kernels' own sources (EmuBackend): every rank the same rows,
    within the BF16 tolerance of the HostBackend run and of the golden."""
    proc = run_worker(tmp_path, device_name, "quant", timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    emu = Results(tmp_path, 2, proc)
    emu.check_scenario("quant")
    for name in QUANT_TP_FIXTURES:
        got = bf16_to_f32(emu.same_on_every_rank(f"quant/{name}"))
        assert rel_err(got, bf16_to_f32(tp2q.same_on_every_rank(f"quant/{name}"))) < 0.02
        assert_matches_golden(got, golden(name)["logits"][QUANT_PREFIX - 1:], f"{name} emu")
    assert np.array_equal(emu.same_on_every_rank("quant_batch"),
                          emu.same_on_every_rank("quant_solo"))
