"""Decode steps of <= 16 rows run the fused GEMMs (ops/gemm_fused.py, layers.py): which
models take them, that they do, and that the logits are bit for bit those of the same steps
unfused, on the twins and on the kernels."""
import numpy as np
import pytest

from metrale.gpu_runtime import HostBackend
from metrale.model_engine import layers
from tests.model.common import load, logits_rows

# qwen2: the qkv bias fused too; q_*: quantized linears (gemm_q.cu's fused entries)
QUANT = ["q_fp8_block", "q_fp8_head", "q_ct_fp8_channel", "q_gptq_v1", "q_gptq_v2_actorder",
         "q_awq"]
FUSABLE = ["llama_gqa", "qwen2", "qwen3", "llama_gelu"] + QUANT
NOT_FUSABLE = ["llama_mlp_bias", "mixtral"]               # an MLP bias; a MoE block
FUSED = ("_16x16_rmsnorm", "_16x16_res", "_16x16_actmul_res")   # gemm_tc_bf16 / gemm_q*_bf16


def fused_kinds(launched) -> set:
    return {f for f in FUSED if any(name.endswith(f) for name in launched)}


def decode_logits(name, backend, rows=2, steps=3):
    """Logits [steps, rows, vocab] of `steps` decode steps of `rows` sequences, and the set
    of kernel functions the steps launched."""
    model = load(name, backend, graphs=False)
    s = model.default_stream()
    seqs = [model.alloc_sequence() for _ in range(rows)]
    for i, seq in enumerate(seqs):
        model.prefill([1 + (7 * i + j) % 50 for j in range(5 + 3 * i)], seq, s)
    launched, orig = set(), backend.launch

    def launch(kernel, *a, **kw):
        launched.add(kernel.function)
        return orig(kernel, *a, **kw)
    backend.launch = launch
    try:
        out = []
        for t in range(steps):
            ptr = model.decode_batch([3 + t + i for i in range(rows)], seqs, s)
            out.append(logits_rows(model, ptr, rows))
    finally:
        del backend.launch
    return np.stack(out), launched


@pytest.mark.parametrize("name", FUSABLE + NOT_FUSABLE)
def test_which_models_fuse(name):
    model = load(name, HostBackend(), graphs=False)
    assert layers.decode_fusable(model, 1) == (name in FUSABLE)
    assert layers.decode_fusable(model, 16) == (name in FUSABLE)
    assert not layers.decode_fusable(model, 17)


def _check(name, backend_factory, monkeypatch):
    fused, launched = decode_logits(name, backend_factory())
    assert fused_kinds(launched) == set(FUSED) and "act_mul" not in launched, sorted(launched)
    if name in QUANT:   # the quantized entries, not BF16 copies
        assert any(f.startswith(("gemm_q4_", "gemm_fp8_")) for f in launched), sorted(launched)
    monkeypatch.setattr(layers, "decode_fusable", lambda model, n: False)
    unfused, launched_u = decode_logits(name, backend_factory())
    assert not fused_kinds(launched_u) and "act_mul" in launched_u
    assert np.array_equal(fused.view(np.uint32), unfused.view(np.uint32)), \
        f"{name}: fused decode logits differ from the unfused steps'"


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_decode_has_the_unfused_bits(name, monkeypatch):
    _check(name, HostBackend, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "q_fp8_block", "q_gptq_v2_actorder",
                                  "q_awq"])
def test_gpu_fused_decode_has_the_unfused_bits(device, name, monkeypatch):
    _check(name, lambda: device, monkeypatch)
