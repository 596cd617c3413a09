"""The hybrid MoE forms in fine-grained FP8 as released (q_fp8_qwen3_5_moe_text,
q_fp8_qwen3_next: make_hybrid_fp8_moe_fixtures.py, 24 x 16 blocks, F32 expert scales, BF16
/ FP16 others; the head, the DeltaNet b / a projections, the routers and the shared experts'
gates BF16): the routed experts stay FP8 in the grouped GEMM, the other linears as the dense
FP8 path keeps them; the logits are, bit for bit, those of the same checkpoint dequantized
to BF16 at load and within tolerance of HF's (fp32 with the dequantized weights)."""
import json

import numpy as np
import pytest

import metrale
from metrale.formats import open_source
from metrale.formats.hybrid_quant import hybrid_quantization
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.gpu_runtime import backend
from metrale.gpu_runtime.types import DevicePtr
from metrale.model_engine.hybrid_weights import hybrid_weight_bytes
from metrale.model_engine.linear import Fp8Linear
from metrale.model_engine.memory_plan import active_weight_bytes
from metrale.model_engine.moe_quant import QuantExperts
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, load, logits_rows

NAMES = ["q_fp8_qwen3_5_moe_text", "q_fp8_qwen3_next"]
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def dequantized(name, be):
    """The same checkpoint as the BF16 one it stands for (dequantized at load)."""
    return metrale.load(DequantizedSource(open_source(FIXTURES / name)), be, progress=False)


def rows_of(model, ids, end):
    seq = model.alloc_sequence()
    out = [logits_rows(model, model.prefill(ids[:70], seq, 0))[0]]
    return np.stack(out + [logits_rows(model, model.decode(t, seq, 0))[0] for t in ids[70:end]])


@pytest.mark.parametrize("device_name", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_fp8_hybrid_moe_matches_hf_and_its_dequantized_checkpoint_bits(name, device_name):
    be = backend(device_name)
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    end = len(ids) if device_name == "cpu" else 73
    got = rows_of(load(name, be), ids, end)
    assert np.array_equal(got, rows_of(dequantized(name, be), ids, end)), \
        "FP8 in the tiles != dequantized"
    assert_matches_golden(got, g["logits"][69:69 + len(got)], f"{name} fp8")


@pytest.mark.parametrize("name", NAMES)
def test_experts_and_linears_stay_fp8_routers_and_gates_bf16_bytes_reported(name):
    m = load(name)
    W = m._weights
    sparse = [L for L in W.layers if L.moe is not None]
    assert sparse
    for L in sparse:
        assert isinstance(L.moe.gate_up, QuantExperts) and L.moe.gate_up.fmt == "fp8"
        assert isinstance(L.moe.down, QuantExperts)
        assert isinstance(L.moe.shared_gate_up, Fp8Linear)
        assert isinstance(L.moe.shared_down, Fp8Linear)
        assert not isinstance(L.moe.router, Fp8Linear)
        assert not isinstance(L.moe.shared_gate, Fp8Linear)
    for L in W.layers:
        if L.kind == "linear_attention":
            assert isinstance(L.in_proj, Fp8Linear) and isinstance(L.out_proj, Fp8Linear)
            assert not isinstance(L.in_proj_ab, Fp8Linear)
        else:
            assert all(isinstance(w, Fp8Linear) for w in (L.qkv, L.gate, L.o_proj))
        if L.moe is None:   # qwen3_next's mlp_only layer
            assert isinstance(L.gate_up, Fp8Linear) and isinstance(L.down_proj, Fp8Linear)
    held = sum(m.backend._sizes[int(DevicePtr(p))] for p in W._owned)
    assert m.weight_bytes() == held == hybrid_weight_bytes(m._meta)
    assert m.weight_bytes() < 0.7 * dequantized(name, m.backend).weight_bytes()
    # a token reads all but its idle experts, counted at their FP8 bytes as held
    moe = m._meta.moe
    expert = (sparse[0].moe.gate_up.nbytes + sparse[0].moe.down.nbytes) // moe.num_experts
    idle = (moe.num_experts - moe.top_k) * moe.num_sparse_layers * expert
    assert active_weight_bytes(m._meta) == m.weight_bytes() - idle


def test_routers_and_shared_gates_are_read_bf16_whatever_the_config_names(tmp_path):
    name = "q_fp8_qwen3_next"
    for f in ("model.safetensors", "generation_config.json"):
        (tmp_path / f).symlink_to(FIXTURES / name / f)
    c = json.loads((FIXTURES / name / "config.json").read_text())
    c["quantization_config"]["modules_to_not_convert"] = ["lm_head", "in_proj_ba"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    ids = golden(name)["input_ids"][0].tolist()
    be = backend("cpu")
    got = metrale.load(tmp_path, be, progress=False)
    assert np.array_equal(rows_of(got, ids, 72), rows_of(load(name, be), ids, 72))


def test_a_moe_wrappers_modules_to_not_convert_are_read_as_the_text_models():
    c = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                 "modules_to_not_convert": [
                                     "lm_head", "model.language_model.layers.0.mlp.experts.1",
                                     "model.visual"]}}
    q = hybrid_quantization(c, "config.json", "qwen3_5_moe")
    assert not q.converts("model.layers.0.mlp.experts.1.gate_proj")
    assert q.converts("model.layers.0.mlp.experts.0.gate_proj")
    assert q.converts("model.layers.1.mlp.experts.1.gate_proj")
