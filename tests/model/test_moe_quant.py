"""Quantized mixture-of-experts checkpoints end to end (issue 41): Qwen3-MoE fixtures whose
experts (and attention) are FP8 block-scaled, GPTQ with act-order or AWQ in the hub's
per-expert layout, routers BF16. Each against its golden (HF fp32 on the dequantized
weights) on HostBackend and the emulator; bit for bit the BF16 model of the dequantized
weights (so the expert tiles dequantize with the dense formula); the experts stay packed
on the device; decode_batch rows equal solo steps whatever the batch shares."""
import numpy as np
import pytest

from metrale.formats import open_source
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.gpu_runtime import backend
from metrale.model_engine.memory_plan import weight_bytes
from metrale.model_engine.moe_quant import QuantExperts
from tests.model.common import FIXTURES, assert_matches_golden, golden, logits_rows
from tests.model.test_quant_golden import EMU, load, run_prompt

QUANT_MOE = {"q_moe_fp8_block": "fp8", "q_moe_gptq_actorder": "q4", "q_moe_awq": "q4"}


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", list(QUANT_MOE))
def test_matches_golden_and_the_dequantized_bf16_model_bit_for_bit(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    be = backend(device_name)
    m = load(FIXTURES / name, be)
    sparse = [L.moe for L in m._weights.layers if L.moe is not None]
    assert sparse and all(isinstance(w.gate_up, QuantExperts) and isinstance(w.down, QuantExperts)
                          and w.gate_up.fmt == QUANT_MOE[name] for w in sparse)
    got = run_prompt(m, ids[:20], 12)
    assert_matches_golden(got, g["logits"][11:20], f"{name} on {device_name}")
    ref = load(DequantizedSource(open_source(FIXTURES / name)), be)
    assert ref._meta.quantization is None
    assert np.array_equal(got, run_prompt(ref, ids[:20], 12)), \
        f"{name}: the quantized MoE differs from its dequantized BF16 model"


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", list(QUANT_MOE))
def test_decode_batch_rows_equal_solo_steps(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(FIXTURES / name, backend(device_name))
    s = m.default_stream()
    lens = [3, 11, 1, 18]
    seqs = []
    for n in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:n], seq, s)
        seqs.append(seq)
    batch = logits_rows(m, m.decode_batch([ids[n] for n in lens], seqs, s), len(lens))
    assert_matches_golden(batch, g["logits"][lens], f"{name} decode_batch")
    for i, n in enumerate(lens):
        assert np.array_equal(run_prompt(m, ids[:n + 1], n)[-1], batch[i]), (name, i)


@pytest.mark.parametrize("name", list(QUANT_MOE))
def test_the_experts_stay_packed_and_the_plan_counts_their_bytes(name):
    """The planned weight bytes are those uploaded, well under the BF16 model's."""
    m = load(FIXTURES / name)
    src = open_source(FIXTURES / name)
    planned = weight_bytes(src.metadata())
    bf16 = weight_bytes(DequantizedSource(src).metadata())
    assert m._weights.nbytes == planned < 0.75 * bf16, (planned, bf16)


def test_compressed_tensors_fp8_block_experts_give_the_fine_grained_bits(tmp_path):
    """compressed-tensors' FP8_BLOCK scheme (`weight_scale`, float32) over the same codes and
    scales as q_moe_fp8_block's fine-grained `weight_scale_inv`: the same model, bit for bit."""
    import json
    from tests.formats.test_quant_formats import copy

    def ct_config(q):
        q.clear()
        q.update({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                      "strategy": "block", "block_structure": [128, 128]},
                      "input_activations": {"num_bits": 8, "type": "float",
                                            "symmetric": True, "dynamic": True,
                                            "strategy": "group", "group_size": 128}}}})

    def renamed(d):
        for n in [n for n in d if n.endswith(".weight_scale_inv")]:
            d[n[:-len("_inv")]] = d.pop(n)
    ct = copy(tmp_path, "q_moe_fp8_block", config=ct_config, tensors=renamed)
    assert json.loads((ct / "config.json").read_text())["quantization_config"]["format"]
    ids = golden("q_moe_fp8_block")["input_ids"][0].tolist()
    rows = [run_prompt(load(p), ids[:14], 10) for p in (FIXTURES / "q_moe_fp8_block", ct)]
    assert np.array_equal(rows[0], rows[1])
