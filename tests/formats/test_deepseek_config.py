"""deepseek_v2 / deepseek_v3 configs (formats/deepseek_config.py): the released configs'
shapes, the latent KV size, the softmax scale with yarn's mscale_all_dim, the routing
fields, every field read listed in the field table, and refusals by name."""
from __future__ import annotations

import math

import pytest

from metrale.errors import FormatError, Unsupported
from metrale.formats import ModelMetadata, expected_tensors
from metrale.formats.deepseek_config import kv_bytes_per_token_layer
from metrale.formats.field_table import FIELD_TABLE, REFUSED
from tests.formats.test_field_table import read_keys

# DeepSeek-V3's config.json as released (the fields that shape the model)
V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
          intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
          num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
          n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
          qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
          num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
          max_position_embeddings=163840, rope_theta=10000, topk_method="noaux_tc",
          scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=1,
          rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0,
                            mscale_all_dim=1.0, original_max_position_embeddings=4096,
                            type="yarn"),
          ep_size=1, aux_loss_alpha=0.001, seq_aux=True, torch_dtype="bfloat16",
          bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, hidden_act="silu",
          rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0)
# DeepSeek-V2-Lite's: no q_lora_rank, greedy softmax routing, 64 experts, 1 dense layer
V2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
               intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
               num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
               n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
               q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               n_group=1, topk_group=1, topk_method="greedy", num_experts_per_tok=6,
               first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax",
               moe_layer_freq=1, max_position_embeddings=163840, rope_theta=10000,
               rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707,
                                 mscale_all_dim=0.707, original_max_position_embeddings=4096,
                                 type="yarn"),
               torch_dtype="bfloat16", bos_token_id=100000, eos_token_id=100001,
               aux_loss_alpha=0.001, seq_aux=True, ep_size=1)


def _mscale(f, m):
    return 0.1 * m * math.log(f) + 1.0


def test_v3_as_released():
    m = ModelMetadata.from_config(dict(V3))
    a = m.mla
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.v_head_dim) == (1536, 512, 192, 128)
    assert a.latent_dim == 576 and a.rope_pairs_adjacent
    # HF: qk_head_dim ** -0.5 * mscale(40, mscale_all_dim) ** 2 (yarn_apply_mscale)
    assert a.softmax_scale == pytest.approx(192 ** -0.5 * _mscale(40, 1.0) ** 2, rel=1e-15)
    # the yarn cos/sin factor: mscale / mscale_all_dim = 1
    assert m.rope_scaling.attention_factor == 1.0 and m.head_dim == 64
    r = m.moe.deepseek
    assert (r.scoring, r.n_group, r.topk_group, r.routed_scaling_factor,
            r.correction_bias) == ("sigmoid", 8, 4, 2.5, True)
    assert m.moe.sparse_layers == (False,) * 3 + (True,) * 58
    assert m.moe.norm_topk_prob and m.moe.shared_expert_intermediate_size == 2048
    # 671B parameters without the MTP layer (DeepSeek's model card: 671B + 14B MTP)
    n = sum(math.prod(s) for s in expected_tensors(m).values())
    assert 670e9 < n < 672e9


# Kimi K2's config.json as released (moonshotai/Kimi-K2-Instruct): model_type kimi_k2, the
# DeepseekV3ForCausalLM architecture with 384 experts and one dense layer
KIMI_K2 = dict(V3, model_type="kimi_k2", vocab_size=163840, num_attention_heads=64,
               num_key_value_heads=64, n_routed_experts=384, routed_scaling_factor=2.827,
               n_group=1, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
               rope_theta=50000.0, max_position_embeddings=131072,
               rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=32.0, mscale=1.0,
                                 mscale_all_dim=1.0, original_max_position_embeddings=4096,
                                 type="yarn"),
               bos_token_id=163584, eos_token_id=163585, pretraining_tp=1,
               architectures=["DeepseekV3ForCausalLM"],
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
               quantization_config=dict(activation_scheme="dynamic", fmt="e4m3",
                                        quant_method="fp8", weight_block_size=[128, 128]))


def test_kimi_k2_reads_as_deepseek_v3():
    # transformers' Kimi_K25Config reads a kimi_k2 text model as deepseek_v3; so does metrale
    m = ModelMetadata.from_config(dict(KIMI_K2))
    assert m.architecture == "deepseek_v3" and m.quantization is not None
    assert (m.moe.num_experts, m.moe.deepseek.routed_scaling_factor, m.num_heads) == \
        (384, 2.827, 64)
    assert m.moe.sparse_layers == (False,) + (True,) * 60
    assert m.mla.softmax_scale == pytest.approx(192 ** -0.5 * _mscale(32, 1.0) ** 2)
    # "1T total parameters": 1.03e12 with the BF16 shapes the FP8 blocks stand for
    n = sum(math.prod(s) for s in expected_tensors(ModelMetadata.from_config(
        {k: v for k, v in KIMI_K2.items() if k != "quantization_config"})).values())
    assert 1.0e12 < n < 1.05e12
    assert read_keys(dict(KIMI_K2), None) and not [
        k for k in KIMI_K2 if k not in FIELD_TABLE["deepseek_v3"]]


def test_kv_bytes_per_token_is_the_latent():
    v3 = ModelMetadata.from_config(dict(V3))
    assert kv_bytes_per_token_layer(v3) == 576 * 2
    lite = ModelMetadata.from_config(dict(V2_LITE))
    assert kv_bytes_per_token_layer(lite) == 576 * 2


def test_v2_lite_as_released():
    m = ModelMetadata.from_config(dict(V2_LITE))
    assert m.mla.q_lora_rank == 0
    names = expected_tensors(m)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.self_attn.q_a_proj.weight" not in names
    assert "model.layers.0.mlp.gate_proj.weight" in names              # dense layer 0
    assert names["model.layers.1.mlp.shared_experts.up_proj.weight"] == (2 * 1408, 2048)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in names
    assert m.moe.deepseek.scoring == "softmax" and m.moe.deepseek.n_group == 1
    assert not m.moe.norm_topk_prob
    assert m.mla.softmax_scale == pytest.approx(192 ** -0.5 * _mscale(40, 0.707) ** 2)
    assert (m.bos_token_id, m.eos_token_ids) == (100000, (100001,))
    assert 15.5e9 < sum(math.prod(s) for s in names.values()) < 16e9   # "16B"


def test_class_defaults_when_absent():
    m = ModelMetadata.from_config({"model_type": "deepseek_v3"})
    assert (m.num_layers, m.mla.latent_dim, m.moe.num_experts, m.bos_token_id) == \
        (61, 576, 256, 0)
    assert m.rope_scaling is None and m.mla.softmax_scale == 192 ** -0.5
    assert m.mla.q_lora_rank == 1536   # the class default (it read as null once)
    v2 = ModelMetadata.from_config({"model_type": "deepseek_v2", "num_experts_per_tok": 6})
    assert (v2.moe.num_experts, v2.eos_token_ids) == (64, (2,))


def test_rope_interleave_and_group_limited_greedy():
    assert not ModelMetadata.from_config({**V3, "rope_interleave": False}).mla \
        .rope_pairs_adjacent
    m = ModelMetadata.from_config({**V2_LITE, "topk_method": "group_limited_greedy",
                                   "n_group": 8, "topk_group": 3})
    assert (m.moe.deepseek.n_group, m.moe.deepseek.topk_group) == (8, 3)


@pytest.mark.parametrize("config", [V3, V2_LITE], ids=["v3", "v2_lite"])
def test_every_field_read_is_in_the_table(config):
    log = read_keys(dict(config), None)
    missing = sorted(f"{s}.{k}" for s, k in log if k not in FIELD_TABLE.get(s, {}))
    assert not missing
    # and every key of the released configs is documented
    assert not [k for k in config if k not in FIELD_TABLE[config["model_type"]]]


@pytest.mark.parametrize("change, error, words", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
     Unsupported, "quant_method='gptq'.*fine-grained fp8"),
    ({"moe_layer_freq": 2}, Unsupported, "moe_layer_freq"),
    ({"attention_bias": True}, Unsupported, "attention_bias"),
    ({"topk_method": "greedy"}, Unsupported, "topk_method"),
    ({"scoring_func": "softmax"}, Unsupported, "scoring_func"),
    ({"partial_rotary_factor": 0.5}, Unsupported, "partial_rotary_factor"),
    ({"n_group": 7}, FormatError, "n_group"),
    ({"topk_group": 9}, FormatError, "topk_group"),
    ({"num_experts_per_tok": 200}, FormatError, "num_experts_per_tok"),
    ({"n_group": 256, "topk_group": 4}, FormatError, "top two"),
    ({"n_group": None}, FormatError, "n_group"),
    ({"qk_rope_head_dim": 63}, FormatError, "qk_rope_head_dim"),
    ({"kv_lora_rank": 4096}, Unsupported, "kv_lora_rank"),
    ({"num_local_experts": 128}, FormatError, "n_routed_experts"),
])
def test_v3_refusals_name_the_field(change, error, words):
    with pytest.raises(error, match=words) as e:
        ModelMetadata.from_config({**V3, **change}, source="ds/config.json")
    assert "ds/config.json" in str(e.value)


@pytest.mark.parametrize("change, error, words", [
    ({"norm_topk_prob": True}, Unsupported, "norm_topk_prob"),
    ({"topk_method": "noaux_tc"}, Unsupported, "topk_method"),
    ({"scoring_func": "sigmoid"}, Unsupported, "scoring_func"),
    ({"hidden_size": 2050}, FormatError, "hidden_size"),
    ({"topk_method": "group_limited_greedy", "n_group": None}, FormatError, "n_group"),
    ({"num_experts_per_tok": None}, FormatError, "num_experts_per_tok"),
    ({"mlp_bias": True}, Unsupported, "mlp_bias"),
])
def test_v2_refusals_name_the_field(change, error, words):
    with pytest.raises(error, match=words):
        ModelMetadata.from_config({**V2_LITE, **change})


def test_refused_fields_are_marked():
    for arch in ("deepseek_v2", "deepseek_v3"):
        assert FIELD_TABLE[arch]["moe_layer_freq"].status == REFUSED
