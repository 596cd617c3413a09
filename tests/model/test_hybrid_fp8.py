"""Qwen3.5 in fine-grained FP8 as released (q_fp8_qwen3_5: 32 x 32 blocks, BF16 and FP16
weight_scale_inv, in_proj_a / in_proj_b and the head left BF16): the linears stay FP8 on the
device, the logits are HF's (fp32 with the dequantized weights) and, bit for bit, those of
the same checkpoint dequantized to BF16 at load; the forms not supported are refused by
name."""
import copy
import json

import numpy as np
import pytest

import metrale
from metrale import Unsupported
from metrale.formats import ModelMetadata, open_source
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.gpu_runtime import backend
from metrale.model_engine.linear import Fp8Linear
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, load, logits_rows

NAME = "q_fp8_qwen3_5"
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def dequantized(be):
    """The same checkpoint as the BF16 one it stands for (dequantized at load)."""
    return metrale.load(DequantizedSource(open_source(FIXTURES / NAME)), be, progress=False)


@pytest.mark.parametrize("device_name", BACKENDS)
def test_fp8_hybrid_matches_hf_and_its_dequantized_checkpoint_bits(device_name):
    be = backend(device_name)
    m = load(NAME, be)
    ref = dequantized(be)
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    rows, want = [], []
    for model, out in ((m, rows), (ref, want)):
        seq = model.alloc_sequence()
        out.append(logits_rows(model, model.prefill(ids[:70], seq, 0))[0])
        end = len(ids) if device_name == "cpu" else 74
        out += [logits_rows(model, model.decode(t, seq, 0))[0] for t in ids[70:end]]
    assert np.array_equal(np.stack(rows), np.stack(want)), "FP8 in the tiles != dequantized"
    assert_matches_golden(np.stack(rows), g["logits"][69:69 + len(rows)], f"{NAME} fp8")


def test_the_linears_stay_fp8_and_b_a_and_the_head_bf16():
    m = load(NAME)
    lin = m._weights.layers[0]
    assert all(isinstance(w, Fp8Linear) for w in (lin.in_proj, lin.out_proj, lin.gate_up,
                                                   lin.down_proj))
    att = m._weights.layers[1]
    assert all(isinstance(w, Fp8Linear) for w in (att.qkv, att.gate, att.o_proj))
    assert not isinstance(lin.in_proj_ab, Fp8Linear)          # modules_to_not_convert
    assert not isinstance(m._weights.lm_head, Fp8Linear)
    bf16 = dequantized(m.backend).weight_bytes()
    assert m.weight_bytes() < 0.75 * bf16
    assert m.memory_plan.weight_bytes == pytest.approx(m.weight_bytes(), rel=0.1)


def cfg(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


QC = {"quant_method": "fp8", "weight_block_size": [128, 128],
      "modules_to_not_convert": ["lm_head"]}


def test_quantized_forms_not_supported_are_refused_by_name():
    c = dict(cfg("nemotron_h"), quantization_config=QC)
    with pytest.raises(Unsupported, match="nemotron_h checkpoint is not supported: "
                                          ".*no quantized Nemotron-H"):
        ModelMetadata.from_config(c, source="config.json")
    gptq = dict(cfg("qwen3_5_text"), quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True})
    with pytest.raises(Unsupported, match="fine-grained fp8, the released form"):
        ModelMetadata.from_config(gptq, source="config.json")


def test_a_wrappers_modules_to_not_convert_are_read_as_the_text_models():
    c = copy.deepcopy(cfg("qwen3_5_vl"))
    c["quantization_config"] = dict(QC, modules_to_not_convert=[
        "lm_head", "model.language_model.layers.0.linear_attn.in_proj_a", "model.visual"])
    q = ModelMetadata.from_config(c, source="config.json").quantization
    assert not q.converts("model.layers.0.linear_attn.in_proj_a")
    assert q.converts("model.layers.1.linear_attn.in_proj_a")
    assert q.converts("model.layers.0.linear_attn.in_proj_qkv")
