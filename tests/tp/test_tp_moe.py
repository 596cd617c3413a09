"""Mixture-of-experts checkpoints (qwen3_moe, qwen2_moe, mixtral) split over ranks on the
CPU under mpiexec: tensor parallel inside every expert (tp/moe_shard.py) at N=2 and N=4, and
expert parallel (tp/expert_parallel.py), at both sizes. Checked: every rank
gets the same rows; the rows match the HF goldens and the single-process run within the
BF16 tolerance; greedy tokens equal the single-process argmax on every clear step; a
sequence's rows are the same bits alone or in a batch; each rank's weight bytes are at most
1/N of the single-process bytes plus the replicated parts (router, shared expert, norms)."""
import numpy as np
import pytest

from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import emu_available
from tests.model.common import MOE_FIXTURES, assert_matches_golden, golden, load, rel_err
from tests.tp.launch import Results, run_worker
from tests.tp.worker_moe import BATCH_LENS, GREEDY_PROMPT, PREFIX, rows_of


class _Host:
    """rows_of's `run` on one process."""

    @staticmethod
    def bits(m, ptr, n: int = 1) -> np.ndarray:
        out = np.empty((n, m.vocab_size()), np.uint16)
        m.copy_logits_to_host(ptr, out)
        return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2_moe")
    proc = run_worker(out, "cpu", "moe,moe_ep,a2av")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp4_moe")
    proc = run_worker(out, "cpu", "moe,moe_ep,a2av", ranks=4)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 4, proc)


def replicated_bytes(name: str, n_ranks: int, ep: bool) -> int:
    """BF16 bytes every rank holds whole: norms, routers, shared experts' gates (expert
    parallel: the shared experts too), (N above num_key_value_heads) the k/v projections,
    whose heads are then copied; expert parallel with N not dividing the experts, the extra
    expert of the ranks that hold one more."""
    m = load(name)
    meta = m._meta
    hid, moe = meta.hidden_size, meta.moe
    per_layer = 2 * hid + moe.num_experts * hid
    if moe.shared_expert_intermediate_size:
        per_layer += (3 * moe.shared_expert_intermediate_size * hid if ep else 0) + hid
    if ep and moe.num_experts % n_ranks:
        per_layer += 3 * moe.expert_intermediate_size * hid
    if meta.qk_norm:
        per_layer += 2 * meta.head_dim
    if n_ranks > meta.num_kv_heads:
        per_layer += 2 * meta.num_kv_heads * meta.head_dim * hid
    total = 2 * (meta.num_layers * per_layer + hid)
    m.teardown()
    return total


def check(res: Results, key: str, name: str, n_ranks: int) -> None:
    res.check_scenario(key.split("@")[0])
    got = bf16_to_f32(res.same_on_every_rank(f"{key}/rows/{name}"))
    assert_matches_golden(got, golden(name)["logits"][PREFIX - 1:], f"{name} {key} N={n_ranks}")
    one = load(name)
    want = bf16_to_f32(rows_of(_Host, one, name))
    # FP32 partial sums added in another order move a row by a few BF16 ulps
    assert rel_err(got, want) < 0.02, f"{name}: {key} N={n_ranks} vs one process"
    # greedy: on every step whose single-process top-2 margin is clear, the same token
    toks = res.same_on_every_rank(f"{key}/greedy/{name}").tolist()
    ids = golden(name)["input_ids"][0, :GREEDY_PROMPT].tolist()
    seq = one.alloc_sequence()
    ptr = one.prefill(ids, seq, 0)
    clear = 0
    for t in toks:
        row = bf16_to_f32(_Host.bits(one, ptr))[0]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] >= 0.05:
            assert t == int(np.argmax(row)), f"{name}: {key} greedy differs on a clear step"
            clear += 1
        ptr = one.decode(t, seq, 0)
    assert clear >= len(toks) // 2, f"{name}: only {clear} clear steps"
    one.teardown()
    batch = res.same_on_every_rank(f"{key}/batch/{name}")
    assert np.array_equal(batch, res.same_on_every_rank(f"{key}/solo/{name}")), \
        f"{name}: {key}: a row depends on its batch"
    whole = load(name)._weights.nbytes
    per_rank = [f[f"{key.split('@')[0]}/weight_bytes"][name] for f in res.facts]
    assert len(set(per_rank)) == 1 or key.startswith("moe_ep")
    assert max(per_rank) <= whole / n_ranks + replicated_bytes(name, n_ranks, key == 'moe_ep'), (name, per_rank, whole)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_expert_tensor_parallel_at_2(tp2, name):
    check(tp2, "moe", name, 2)


def test_expert_tensor_parallel_with_decode_graphs(tp2):
    """Graph replays of the MoE layers' reductions give the eager rows' bits."""
    tp2.check_scenario("moe")
    assert np.array_equal(tp2.same_on_every_rank("moe/graphs/qwen2_moe"),
                          tp2.same_on_every_rank("moe/rows/qwen2_moe"))
    assert all(f["moe/graphs_captured"] > 0 for f in tp2.facts)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_expert_tensor_parallel_at_4(tp4, name):
    check(tp4, "moe", name, 4)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_expert_parallel_at_2(tp2, name):
    check(tp2, "moe_ep", name, 2)
    assert all(f["moe_ep/is_ep"][name] for f in tp2.facts)
    assert not any(f["moe/is_ep"][name] for f in tp2.facts)
    # tokens really went over the all-to-all: every rank dispatched some
    assert all(f["moe_ep/dispatched_rows"][name] > 0 for f in tp2.facts)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_expert_parallel_at_4(tp4, name):
    """qwen2_moe's 6 experts split 1, 2, 1, 2 over 4 ranks."""
    check(tp4, "moe_ep", name, 4)


@pytest.mark.parametrize("size", [2, 4])
def test_an_expert_parallel_block_is_the_single_device_block_bit_for_bit(tp2, tp4, size):
    """qwen2_moe's layer-0 MoE block (routed and shared experts) on 7 rows: dispatched,
    computed on the experts' ranks, returned and combined, it is the one-process block's
    output bit for bit, at N=2 and N=4 (tests/tp/worker_moe.py: ep_block_bits)."""
    res = tp2 if size == 2 else tp4
    res.check_scenario("moe_ep")
    ep = res.same_on_every_rank("ep_block/ep")
    assert np.array_equal(ep, res.arrays[0]["ep_block/one"])
    assert np.any(ep != 0)


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all_v_over_mpi(tp2, tp4, size):
    res = tp2 if size == 2 else tp4
    res.check_scenario("a2av")
    for a in res.arrays:
        assert a["a2av/got"].tolist() == a["a2av/want"].tolist()


def test_the_original_ep_contract_runs_spmd(tp2):
    """ModelEp (tp/ep_contract.py): the head's broadcasts are agreed checks on every rank."""
    for f in tp2.facts:
        assert f["ep_tokens"] == [5, 6, 7]
        assert f["ep_mismatch"].startswith("TensorParallelError"), f["ep_mismatch"]
        assert "ep_broadcast_cmd" in f["ep_mismatch"]
        assert f["ep_graphs"].startswith("Unsupported") and "graphs" in f["ep_graphs"]


@pytest.mark.parametrize("device_name", [pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_emu_moe_batch_invariance(tmp_path, device_name):
    """The kernels' own sources (EmuBackend) at N=2: qwen2_moe's rows alone equal its rows
    in a batch, tensor and expert parallel (the combine over k * N slots, the FP32 row
    gather), and match the goldens."""
    proc = run_worker(tmp_path, device_name, "moe_emu")
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = Results(tmp_path, 2, proc)
    res.check_scenario("moe_emu")
    for key in ("moe", "moe_ep"):
        batch = res.same_on_every_rank(f"emu/{key}/batch")
        assert np.array_equal(batch, res.same_on_every_rank(f"emu/{key}/solo")), key
        assert_matches_golden(bf16_to_f32(batch), golden("qwen2_moe")["logits"][BATCH_LENS],
                              f"emu {key} N=2")
