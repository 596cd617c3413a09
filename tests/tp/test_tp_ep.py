"""Expert parallelism over mixture-of-experts checkpoints (issue 41), on the CPU under
mpiexec at N=2 and N=4 (tp/expert_parallel.py: whole experts a rank, tokens dispatched and
the outputs returned by all_to_all_v, combined in slot order on the token's home rank):
qwen3_moe, qwen2_moe (shared expert), mixtral, and the quantized Qwen3-MoE fixtures (FP8
block, GPTQ act-order, AWQ: experts whole on their rank, packed as released). Checked:
every rank the same rows; the HF goldens and the single-process run within the BF16
tolerance; greedy tokens equal the single-process argmax on every clear step; batch rows
equal solo rows bit for bit; each rank's weight bytes at most 1/N of the single-process
bytes plus the replicated parts; one MoE block equal to the one-process block bit for bit;
the communicator's all_to_all_v; the original's ModelEp contract on SPMD ranks."""
import numpy as np
import pytest

from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import emu_available
from tests.model.common import MOE_FIXTURES, assert_matches_golden, golden, load, rel_err
from tests.tp.launch import Results, run_worker
from tests.tp.worker_moe import (BATCH_LENS, GREEDY_PROMPT, MOE_PREFIX, QUANT_MOE_EP,
                                 rows_of)


class _Host:
    """rows_of's `run` on one process."""

    @staticmethod
    def bits(m, ptr, n: int = 1) -> np.ndarray:
        out = np.empty((n, m.vocab_size()), np.uint16)
        m.copy_logits_to_host(ptr, out)
        return out


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2")
    proc = run_worker(out, "cpu", "moe_ep,a2av")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


@pytest.fixture(scope="module")
def ep4(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep4")
    proc = run_worker(out, "cpu", "moe_ep,a2av", ranks=4)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 4, proc)


def replicated_bytes(name: str, n_ranks: int) -> int:
    """BF16 bytes every rank holds whole under expert parallelism: norms, routers, shared
    experts and their gates, (N above num_key_value_heads) the copied k/v heads, and, N not
    dividing the experts, one more expert (an upper bound for a packed quantized one)."""
    m = load(name)
    meta = m._meta
    hid, moe = meta.hidden_size, meta.moe
    per_layer = 2 * hid + moe.num_experts * hid
    if moe.shared_expert_intermediate_size:
        per_layer += 3 * moe.shared_expert_intermediate_size * hid + hid
    if moe.num_experts % n_ranks:
        per_layer += 3 * moe.expert_intermediate_size * hid
    if meta.qk_norm:
        per_layer += 2 * meta.head_dim
    if n_ranks > meta.num_kv_heads:
        per_layer += 2 * meta.num_kv_heads * meta.head_dim * hid
    total = 2 * (meta.num_layers * per_layer + hid)
    m.teardown()
    return total


def check(res: Results, name: str, n_ranks: int) -> None:
    res.check_scenario("moe_ep")
    got = bf16_to_f32(res.same_on_every_rank(f"moe_ep/rows/{name}"))
    assert_matches_golden(got, golden(name)["logits"][MOE_PREFIX - 1:], f"{name} EP N={n_ranks}")
    one = load(name)
    want = bf16_to_f32(rows_of(_Host, one, name))
    assert rel_err(got, want) < 0.02, f"{name}: EP N={n_ranks} vs one process"
    # greedy: on every step whose single-process top-2 margin is clear, the same token
    toks = res.same_on_every_rank(f"moe_ep/greedy/{name}").tolist()
    ids = golden(name)["input_ids"][0, :GREEDY_PROMPT].tolist()
    seq = one.alloc_sequence()
    ptr = one.prefill(ids, seq, 0)
    clear = 0
    for t in toks:
        row = bf16_to_f32(_Host.bits(one, ptr))[0]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] >= 0.05:
            assert t == int(np.argmax(row)), f"{name}: EP greedy differs on a clear step"
            clear += 1
        ptr = one.decode(t, seq, 0)
    assert clear >= len(toks) // 2, f"{name}: only {clear} clear steps"
    whole = one._weights.nbytes
    one.teardown()
    assert np.array_equal(res.same_on_every_rank(f"moe_ep/batch/{name}"),
                          res.same_on_every_rank(f"moe_ep/solo/{name}")), \
        f"{name}: EP: a row depends on its batch"
    per_rank = [f["moe_ep/weight_bytes"][name] for f in res.facts]
    bound = whole / n_ranks + replicated_bytes(name, n_ranks)
    if name == "q_moe_gptq_actorder":   # + the split attention linears' act-order tables
        bound += 0.01 * whole            # and the shuffled groups' scales on every rank
    assert max(per_rank) <= bound, (name, per_rank, whole, bound)
    print(f"{name}: one process {whole} bytes, EP N={n_ranks} per rank {per_rank}")
    assert all(f["moe_ep/is_ep"][name] for f in res.facts)
    # tokens really went over the all-to-all: every rank dispatched some
    assert all(f["moe_ep/dispatched_rows"][name] > 0 for f in res.facts)


@pytest.mark.parametrize("name", MOE_FIXTURES + list(QUANT_MOE_EP[2]))
def test_expert_parallel_at_2(ep2, name):
    check(ep2, name, 2)


@pytest.mark.parametrize("name", MOE_FIXTURES + list(QUANT_MOE_EP[4]))
def test_expert_parallel_at_4(ep4, name):
    """qwen2_moe's and the quantized fixtures' 6 experts split 1, 2, 1, 2 over 4 ranks."""
    check(ep4, name, 4)


@pytest.mark.parametrize("size", [2, 4])
def test_an_expert_parallel_block_is_the_single_device_block_bit_for_bit(ep2, ep4, size):
    """qwen2_moe's layer-0 MoE block (routed and shared experts) on 7 rows: dispatched,
    computed on the experts' ranks, returned and combined, it is the one-process block's
    output bit for bit (tests/tp/worker_moe.py: ep_block_bits)."""
    res = ep2 if size == 2 else ep4
    res.check_scenario("moe_ep")
    ep = res.same_on_every_rank("ep_block/ep")
    assert np.array_equal(ep, res.arrays[0]["ep_block/one"])
    assert np.any(ep != 0)


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all_v_over_mpi(ep2, ep4, size):
    res = ep2 if size == 2 else ep4
    res.check_scenario("a2av")
    for a in res.arrays:
        assert a["a2av/got"].tolist() == a["a2av/want"].tolist()


def test_the_original_ep_contract_runs_spmd(ep2):
    """ModelEp (tp/ep_contract.py): the head's broadcasts are agreed checks on every rank;
    is_ep() only under expert_parallel; graphs refused by name."""
    for f in ep2.facts:
        assert f["ep_tokens"] == [5, 6, 7]
        assert f["ep_mismatch"].startswith("TensorParallelError"), f["ep_mismatch"]
        assert "ep_broadcast_cmd" in f["ep_mismatch"]
        assert f["tp_is_ep"] is False
        assert f["ep_graphs"].startswith("Unsupported") and "graphs" in f["ep_graphs"]


@pytest.mark.parametrize("device_name", [pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_expert_parallel_on_the_emulator(tmp_path, device_name):
    """The kernels' own sources (EmuBackend) at N=2, expert parallel: qwen2_moe's and the
    FP8 MoE's rows match the goldens, qwen2_moe's rows alone equal its rows in a batch."""
    proc = run_worker(tmp_path, device_name, "moe_ep_emu", timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    res = Results(tmp_path, 2, proc)
    res.check_scenario("moe_ep_emu")
    for name in ("qwen2_moe", "q_moe_fp8_block"):
        got = bf16_to_f32(res.same_on_every_rank(f"emu_ep/rows/{name}"))
        assert_matches_golden(got, golden(name)["logits"][MOE_PREFIX - 1:], f"{name} emu EP")
    batch = res.same_on_every_rank("emu_ep/batch")
    assert np.array_equal(batch, res.same_on_every_rank("emu_ep/solo"))
    assert_matches_golden(bf16_to_f32(batch), golden("qwen2_moe")["logits"][BATCH_LENS],
                          "emu EP batch")
