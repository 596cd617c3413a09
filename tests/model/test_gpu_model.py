"""GPU: the whole decoder on CudaBackend against the same goldens; graphs equal eager; rows
batch-invariant; the GPU agrees with HostBackend to within BF16 rounding."""
import numpy as np
import pytest

from metrale.gpu_runtime.emu import EmuBackend
from metrale.ops.argmax import argmax_rule
from tests.conftest import TOL, emu_available, rel_max_error
from tests.model.common import (DECODER_FIXTURES, FAMILY_FIXTURES, assert_matches_golden, golden,
                                load, logits_rows)


def teacher_forced(m, ids, split=9):
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:split], seq, s))[0]]
    for t in range(split, len(ids)):
        rows.append(logits_rows(m, m.decode(ids[t], seq, s))[0])
    m.free_sequence(seq)
    return np.stack(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODER_FIXTURES + FAMILY_FIXTURES)
def test_gpu_model_matches_golden_and_host(device, host, name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    gpu = load(name, device, graphs=False)
    rows = teacher_forced(gpu, ids)
    assert_matches_golden(rows[:-1], g["logits"][8:23], f"{name} on GPU")
    host_rows = teacher_forced(load(name, host), ids)
    assert rel_max_error(rows, host_rows) < TOL["model_device_vs_host_rel_max"][0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
def test_gpu_graphs_equal_eager_and_batch_invariance(device, name):
    ids = golden(name)["input_ids"][0].tolist()
    eager = teacher_forced(load(name, device, graphs=False), ids)
    graphed = teacher_forced(load(name, device, graphs=True), ids)
    assert np.array_equal(eager, graphed)
    m = load(name, device, graphs=True)
    s = m.default_stream()
    lens = [3, 11, 1, 18, 7]
    seqs = []
    for L in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:L], seq, s)
        seqs.append(seq)
    batch = logits_rows(m, m.decode_batch([ids[L] for L in lens], seqs, s), len(lens))
    assert m.argmax_batch(m.logits_buffer_ptr(), len(lens), s) == \
        [int(x) for x in argmax_rule(batch)]
    for i, L in enumerate(lens):
        solo = m.alloc_sequence()
        m.prefill(ids[:L], solo, s)
        row = logits_rows(m, m.decode(ids[L], solo, s))
        assert np.array_equal(row[0], batch[i]), f"{name}: GPU row {i} depends on the batch"


@pytest.mark.gpu
def test_gpu_speculative_equals_greedy(device):
    from metrale.engine import generate, speculative_generate
    ids = golden("llama_gqa")["input_ids"][0, :9].tolist()
    t, d = load("llama_gqa", device), load("qwen3", device)
    want = generate(t, ids, 16, stop_token_ids=[]).tokens
    for k in (1, 4):
        assert speculative_generate(t, d, ids, 16, k=k, stop_token_ids=[]).tokens == want


@pytest.mark.gpu
@pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
@pytest.mark.parametrize("device_name", ["emu"])
def test_emu_runs_every_kernel_compiled_and_no_twin(device_name):
    emu = EmuBackend()
    ids = golden("llama_gqa")["input_ids"][0].tolist()
    teacher_forced(load("llama_gqa", emu, graphs=True), ids)
    stats = emu.launch_stats()
    twins = {k for k, v in stats.items() if v["twin"]}
    assert twins == set()  # prefill GEMMs too are the tensor-core kernel, no cuBLAS twin
    compiled = {k for k, v in stats.items() if v["compiled"]}
    assert not any(k.startswith("gemv.") for k in compiled)  # never mixed with gemm_tc
    # llama_gqa's head_dim 16 takes the tensor-core prefill attention
    assert {"gemm_tc.gemm_tc_bf16_16x16", "attention_tc.prefill_attention_tc_d16",
            "rope.rope_write_kv", "rmsnorm.rmsnorm", "activation.act_mul",
            "embedding.embedding", "attention.decode_attention_combine"} <= compiled
