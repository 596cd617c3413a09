"""qwen2_moe / qwen3_moe / mixtral configs as transformers 5.25 resolves them
(formats/moe_config.py): defaults, aliases, sparse layers, windows, the checkpoint layout,
the presets' sizes and every refusal."""
import pytest

from metrale.errors import FormatError, Unsupported
from metrale.formats import ModelMetadata, expected_tensors, num_parameters, preset_config
from metrale.formats.moe_config import expert_parameters, inactive_parameters


def cfg(arch, **kw):
    base = dict(model_type=arch, vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return {k: v for k, v in base.items() if v is not ...}


def meta(arch, **kw):
    return ModelMetadata.from_config(cfg(arch, **kw))


def test_class_defaults_of_absent_keys():
    q3 = meta("qwen3_moe", num_key_value_heads=...)
    assert q3.num_kv_heads == 4 and q3.head_dim == 8 and q3.qk_norm  # not qwen3's 128
    assert (q3.moe.num_experts, q3.moe.top_k, q3.moe.expert_intermediate_size) == (128, 8, 768)
    assert not q3.moe.norm_topk_prob and q3.max_position_embeddings == 32768
    q2 = meta("qwen2_moe", num_key_value_heads=..., num_attention_heads=16, hidden_size=64)
    assert q2.num_kv_heads == 16 and q2.attention_bias and not q2.o_proj_bias
    assert (q2.moe.num_experts, q2.moe.top_k, q2.moe.expert_intermediate_size,
            q2.moe.shared_expert_intermediate_size) == (60, 4, 1408, 5632)
    mx = meta("mixtral", num_key_value_heads=..., num_attention_heads=8)
    assert mx.num_kv_heads == 8 and mx.rope_theta == 1e6 and mx.sliding_window is None
    assert mx.moe.norm_topk_prob and mx.moe.expert_intermediate_size == 48
    assert (mx.moe.num_experts, mx.moe.top_k) == (8, 2) and mx.max_position_embeddings == 131072
    assert meta("mixtral", rope_theta=5.0).rope_theta == 5.0
    assert meta("qwen3_moe").rope_theta == 10000.0


def test_expert_count_aliases():
    assert meta("qwen3_moe", num_local_experts=6, num_experts_per_tok=2).moe.num_experts == 6
    assert meta("mixtral", num_experts=6).moe.num_experts == 6
    assert meta("mixtral", num_experts=6, num_local_experts=6).moe.num_experts == 6
    for arch in ("qwen3_moe", "mixtral"):
        with pytest.raises(FormatError, match="num_experts=4 and num_local_experts=5 disagree"):
            meta(arch, num_experts=4, num_local_experts=5, num_experts_per_tok=2)
    # qwen2_moe reads num_experts only (HF's class has no alias)
    assert meta("qwen2_moe", num_experts=6, num_local_experts=3,
                num_experts_per_tok=2).moe.num_experts == 6


def test_sparse_layers():
    m = meta("qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    assert m.moe.sparse_layers == (False, True, False, True)
    m = meta("qwen2_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1, 2])
    assert m.moe.sparse_layers == (True, False, False, True)
    m = meta("qwen3_moe", num_experts=0)   # HF: every layer the dense MLP
    assert m.moe.sparse_layers == (False,) * 4
    assert not any(".experts." in n for n in expected_tensors(m))
    assert meta("mixtral", mlp_only_layers=[0]).moe.sparse_layers == (True,) * 4  # not read


def test_layouts():
    t = expected_tensors(meta("mixtral", num_local_experts=3))
    p = "model.layers.2.block_sparse_moe."
    assert t[p + "gate.weight"] == (3, 32) and t[p + "experts.2.w1.weight"] == (48, 32)
    assert t[p + "experts.0.w3.weight"] == (48, 32) and t[p + "experts.1.w2.weight"] == (32, 48)
    assert not any("mlp." in n for n in t)
    t = expected_tensors(meta("qwen2_moe", num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=16, shared_expert_intermediate_size=24,
                              mlp_only_layers=[3], qkv_bias=False))
    p = "model.layers.0.mlp."
    assert t[p + "experts.1.down_proj.weight"] == (32, 16)
    assert t[p + "shared_expert.gate_proj.weight"] == (24, 32)
    assert t[p + "shared_expert_gate.weight"] == (1, 32)
    assert t["model.layers.3.mlp.gate_proj.weight"] == (48, 32)     # the dense layer
    assert not any(n.endswith("_proj.bias") for n in t)


def test_windows():
    q2 = meta("qwen2_moe", use_sliding_window=True, sliding_window=7, max_window_layers=3)
    assert q2.layer_windows == (7, 0, 7, 0)        # HF's default layer_types for qwen2_moe
    q2 = meta("qwen2_moe", use_sliding_window=True, sliding_window=7,
              layer_types=["full_attention", "sliding_attention"] * 2)
    assert q2.layer_windows == (0, 7, 0, 7)
    with pytest.raises(Unsupported, match="gives no window"):
        meta("qwen2_moe", layer_types=["sliding_attention"] * 4)
    assert meta("qwen3_moe", use_sliding_window=True, sliding_window=5).layer_windows == (5,) * 4
    assert meta("qwen3_moe", sliding_window=5).layer_windows == (0,) * 4
    assert meta("mixtral", sliding_window=9).layer_windows == (9,) * 4


@pytest.mark.parametrize("arch,kw,err,match", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=5), FormatError,
     "num_experts_per_tok=5 exceeds the expert count 4"),
    ("mixtral", dict(num_local_experts=2, num_experts_per_tok=3), FormatError,
     "num_experts_per_tok=3 exceeds"),
    ("qwen3_moe", dict(num_experts=600), Unsupported, "at most 512 experts"),
    ("qwen3_moe", dict(num_experts=64, num_experts_per_tok=33), Unsupported, "top-32"),
    ("qwen3_moe", dict(mlp_only_layers=[4]), FormatError, "mlp_only_layers holds 4"),
    ("qwen2_moe", dict(mlp_only_layers=[-1]), FormatError, "mlp_only_layers holds -1"),
    ("qwen2_moe", dict(mlp_only_layers=3), FormatError, "mlp_only_layers must be a list"),
    ("qwen3_moe", dict(decoder_sparse_step=0), FormatError, "decoder_sparse_step must be"),
    ("qwen3_moe", dict(num_key_value_heads=None), FormatError, "num_key_value_heads is null"),
    ("qwen2_moe", dict(head_dim=None), FormatError, "head_dim is null"),
    ("mixtral", dict(num_local_experts=0), FormatError, "num_local_experts must be >= 1"),
    ("qwen3_moe", dict(hidden_size=30), FormatError, "not a multiple of"),
    # quantized experts: what the dense families refuse is refused by name here too
    ("mixtral", dict(quantization_config={"quant_method": "bitsandbytes"}), Unsupported,
     "bitsandbytes"),
    ("qwen2_moe", dict(quantization_config={"quant_method": "gptq", "bits": 8}), Unsupported,
     "bits = 8"),
])
def test_refusals_name_the_field(arch, kw, err, match):
    with pytest.raises(err, match=match):
        meta(arch, **kw)


@pytest.mark.parametrize("arch,q", [
    ("qwen3_moe", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
    ("qwen2_moe", {"quant_method": "gptq", "bits": 4, "group_size": 16}),
    ("mixtral", {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"})])
def test_quantized_experts_are_read(arch, q):
    """A quantized MoE config parses (it was refused by name before quantized experts)."""
    assert meta(arch, quantization_config=q).quantization.method == q["quant_method"]


def test_a_large_top_k_is_fine_when_no_layer_is_sparse():
    assert meta("qwen3_moe", num_experts=0, num_experts_per_tok=8).moe.num_sparse_layers == 0


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-30b-a3b", 30.53, 3.35), ("mixtral-8x7b", 46.70, 12.88),
    ("qwen1.5-moe-a2.7b", 14.32, 2.69)])
def test_preset_sizes(name, total, active):
    """The published totals and active parameters (Qwen3-30B-A3B: 30.5B / 3.3B; Mixtral
    8x7B: 46.7B / 12.9B; Qwen1.5-MoE-A2.7B: 14.3B / 2.7B)."""
    m = ModelMetadata.from_config(preset_config(name)[0])
    assert num_parameters(m) / 1e9 == pytest.approx(total, abs=0.01)
    assert (num_parameters(m) - inactive_parameters(m)) / 1e9 == pytest.approx(active, abs=0.01)


def test_inactive_parameters_over_batch_sizes():
    m = ModelMetadata.from_config(preset_config("qwen3-30b-a3b")[0])
    per = expert_parameters(m) * 48
    assert inactive_parameters(m, 1) == 120 * per              # 8 of 128 experts read
    seq = [inactive_parameters(m, n) for n in (1, 2, 8, 64, 1024)]
    assert seq == sorted(seq, reverse=True) and seq[-1] < per  # nearly every expert at 1024
    assert inactive_parameters(meta("qwen3", intermediate_size=48)) == 0
