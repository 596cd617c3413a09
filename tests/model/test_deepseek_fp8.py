"""DeepSeek-V3 in fine-grained FP8 as released (q_fp8_deepseek_v3, make_deepseek_fixtures.py:
24 x 16 blocks straddling kv_a_proj_with_mqa's latent / rope split and kv_b_proj's heads,
F32 attention scales, BF16 MLP scales, an MTP layer held and not read): the linears and
the routed experts stay FP8 on the device, kv_b_proj is dequantized at load (the absorbed
attention reads it per head), the logits are, bit for bit, those of the same checkpoint
dequantized to BF16 at load and within tolerance of HF's (fp32 on the dequantized weights);
what else a DeepSeek quantization_config could say is refused by name."""
import copy
import json

import numpy as np
import pytest

import metrale
from metrale import FormatError, Unsupported
from metrale.formats import MemorySource, ModelMetadata, open_source
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.gpu_runtime import backend
from metrale.gpu_runtime.types import DevicePtr
from metrale.model_engine.deepseek_fp8 import deepseek_fp8_bytes
from metrale.model_engine.linear import Fp8Linear
from metrale.model_engine.memory_plan import active_weight_bytes, weight_bytes
from metrale.model_engine.moe_quant import QuantExperts
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, load, logits_rows

NAME = "q_fp8_deepseek_v3"
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def dequantized(be):
    """The same checkpoint as the BF16 one it stands for (dequantized at load)."""
    return metrale.load(DequantizedSource(open_source(FIXTURES / NAME)), be, progress=False)


@pytest.mark.parametrize("device_name", BACKENDS)
def test_fp8_deepseek_matches_hf_and_its_dequantized_checkpoint_bits(device_name):
    be = backend(device_name)
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    end = len(ids) if device_name == "cpu" else 12
    rows, want = [], []
    for model, out in ((load(NAME, be), rows), (dequantized(be), want)):
        seq = model.alloc_sequence()
        out.append(logits_rows(model, model.prefill(ids[:8], seq, 0))[0])
        out += [logits_rows(model, model.decode(t, seq, 0))[0] for t in ids[8:end]]
    assert np.array_equal(np.stack(rows), np.stack(want)), "FP8 in the tiles != dequantized"
    assert_matches_golden(np.stack(rows), g["logits"][7:7 + len(rows)], f"{NAME} fp8")


def test_linears_and_experts_stay_fp8_kv_b_is_dequantized_and_bytes_are_reported():
    m = load(NAME)
    W = m._weights
    dense, sparse = W.layers[0], W.layers[1]
    for L in (dense, sparse):
        assert all(isinstance(w, Fp8Linear) for w in (L.q_a, L.q_b, L.kv_a_c, L.kv_a_kr,
                                                      L.o_proj))
        assert (L.kv_a_c.n, L.kv_a_kr.n) == (32, 8)   # one upload, two views
        assert not isinstance(L.kv_b, Fp8Linear)       # BF16 for the absorbed attention
    assert isinstance(dense.gate_up, Fp8Linear) and isinstance(dense.down_proj, Fp8Linear)
    assert isinstance(sparse.moe.gate_up, QuantExperts) and sparse.moe.gate_up.fmt == "fp8"
    assert isinstance(sparse.moe.down, QuantExperts)
    assert isinstance(sparse.moe.shared_gate_up, Fp8Linear)
    assert not isinstance(W.lm_head, Fp8Linear) and not isinstance(sparse.moe.router,
                                                                    Fp8Linear)
    held = sum(m.backend._sizes[int(DevicePtr(p))] for p in W._owned)
    assert m.weight_bytes() == held == deepseek_fp8_bytes(m._meta) == weight_bytes(m._meta)
    bf16 = dequantized(m.backend).weight_bytes()
    assert m.weight_bytes() < 0.7 * bf16
    # a token reads all but its idle experts, counted at their FP8 bytes as held
    moe = m._meta.moe
    expert = (sparse.moe.gate_up.nbytes + sparse.moe.down.nbytes) // moe.num_experts
    idle = (moe.num_experts - moe.top_k) * moe.num_sparse_layers * expert
    assert active_weight_bytes(m._meta) == m.weight_bytes() - idle


def test_a_v2_lite_layout_in_fp8_runs_its_q_proj_fp8_and_equals_its_dequantized_bits():
    """q_lora_rank null (q_proj straight from the hidden state): random FP8 weights at the
    deepseek_v2 fixture's shapes."""
    c = json.loads((FIXTURES / "deepseek_v2" / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [24, 16]}
    be = backend("cpu")
    m = metrale.load(MemorySource(c), be, progress=False)
    assert isinstance(m._weights.layers[0].q_proj, Fp8Linear)
    out = []
    for model in (m, metrale.load(DequantizedSource(MemorySource(c)), be, progress=False)):
        seq = model.alloc_sequence()
        rows = [logits_rows(model, model.prefill([5, 6, 7, 8, 9], seq, 0))[0]]
        out.append(np.stack(rows + [logits_rows(model, model.decode(t, seq, 0))[0]
                                    for t in (10, 11, 12)]))
    assert np.isfinite(out[0]).all() and np.array_equal(*out)


def cfg():
    return json.loads((FIXTURES / NAME / "config.json").read_text())


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
     "quant_method='gptq'.*fine-grained fp8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
          "dynamic": False}}}}, "quant_method='compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
])
def test_other_quantization_configs_are_refused_by_name(qc, words):
    with pytest.raises(Unsupported, match=words):
        ModelMetadata.from_config(dict(cfg(), quantization_config=qc), source="config.json")


def test_a_quantized_tensor_on_a_module_left_bf16_is_refused_by_name(tmp_path):
    for f in ("model.safetensors", "generation_config.json"):
        (tmp_path / f).symlink_to(FIXTURES / NAME / f)
    c = copy.deepcopy(cfg())
    c["quantization_config"]["modules_to_not_convert"] = ["lm_head", "kv_b_proj"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(FormatError, match="kv_b_proj.weight.* is quantized, but "
                                          "quantization_config.modules_to_not_convert"):
        metrale.load(tmp_path, backend("cpu"), progress=False)


def test_the_mtp_layer_of_an_fp8_checkpoint_stays_unread_and_mtp_true_is_refused():
    """The released FP8 checkpoints hold an FP8 MTP layer: loaded by default without it
    (it needs the quantized upload, not built for it), and refused by name when asked for."""
    src = open_source(FIXTURES / NAME)
    assert any(n.startswith("model.layers.3.") for n in src.tensor_names())   # the MTP layer
    m = metrale.load(src, backend("cpu"), progress=False)
    assert not m.has_proposer()
    with pytest.raises(Unsupported, match=r"mtp=True: the MTP module of a quantized "
                                          r"checkpoint \(fp8\)"):
        metrale.load(open_source(FIXTURES / NAME), backend("cpu"), progress=False, mtp=True)
