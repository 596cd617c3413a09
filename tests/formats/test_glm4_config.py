"""glm4_moe / glm4_moe_lite configs (formats/glm4_config.py, deepseek_config.py): the
released configs' shapes, the partial rope's width and where its factor comes from, the
routing fields, every field read listed in the field table, and refusals by name."""
from __future__ import annotations

import pytest

from metrale.errors import FormatError, Unsupported
from metrale.formats import ModelMetadata, expected_tensors
from metrale.formats.field_table import FIELD_TABLE, REFUSED
from metrale.formats.key_names import unloaded_prefixes
from tests.formats.test_field_table import read_keys

# GLM-4.5's config.json as released (the fields that shape the model)
GLM45 = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], attention_bias=True,
             attention_dropout=0.0, pad_token_id=151329,
             eos_token_id=[151329, 151336, 151338], head_dim=128, hidden_act="silu",
             hidden_size=5120, partial_rotary_factor=0.5, initializer_range=0.02,
             intermediate_size=12288, max_position_embeddings=131072,
             moe_intermediate_size=1536, norm_topk_prob=True, num_attention_heads=96,
             n_group=1, topk_group=1, n_routed_experts=160, n_shared_experts=1,
             routed_scaling_factor=2.5, num_experts_per_tok=8, first_k_dense_replace=3,
             num_hidden_layers=92, num_key_value_heads=8, rms_norm_eps=1e-5,
             rope_scaling=None, rope_theta=1000000, num_nextn_predict_layers=1,
             tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
             use_qk_norm=True, vocab_size=151552)
# GLM-4.5-Air's: no q/k norm, 46 layers, one dense layer, 128 experts
GLM45_AIR = dict(GLM45, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                 n_routed_experts=128, routed_scaling_factor=1.0, first_k_dense_replace=1,
                 num_hidden_layers=46, use_qk_norm=False)
# GLM-4.7-Flash's (glm4_moe_lite)
GLM47_FLASH = dict(model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"],
                   vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                   moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                   num_key_value_heads=20, hidden_act="silu", rms_norm_eps=1e-5,
                   attention_dropout=0.0, attention_bias=False, max_position_embeddings=202752,
                   rope_theta=1000000.0, rope_scaling=None, partial_rotary_factor=1.0,
                   q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                   v_head_dim=256, n_routed_experts=64, n_shared_experts=1,
                   num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=1.8,
                   n_group=1, topk_group=1, topk_method="noaux_tc", first_k_dense_replace=1,
                   num_nextn_predict_layers=1, tie_word_embeddings=False, dtype="bfloat16")


def test_glm45_as_released():
    m = ModelMetadata.from_config(dict(GLM45))
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.variant.rotary_dim) == (96, 8, 128, 64)
    assert m.attention_bias and not m.o_proj_bias and m.qk_norm and m.mla is None
    assert m.rope_theta == 1e6 and m.rope_scaling is None and m.rms_norm_eps == 1e-5
    r, moe = m.moe.deepseek, m.moe
    assert (r.scoring, r.n_group, r.topk_group, r.routed_scaling_factor, r.correction_bias) == \
        ("sigmoid", 1, 1, 2.5, True)
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.expert_intermediate_size,
            moe.shared_expert_intermediate_size) == (160, 8, True, 1536, 1536)
    assert moe.sparse_layers[:4] == (False, False, False, True) and all(moe.sparse_layers[3:])
    t = expected_tensors(m)
    assert t["model.layers.0.self_attn.q_proj.weight"] == (96 * 128, 5120)
    assert t["model.layers.0.self_attn.k_proj.bias"] == (8 * 128,)
    assert t["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "model.layers.0.self_attn.o_proj.bias" not in t
    assert t["model.layers.3.mlp.gate.e_score_correction_bias"] == (160,)
    assert t["model.layers.3.mlp.shared_experts.down_proj.weight"] == (5120, 1536)
    assert "model.layers.2.mlp.gate.weight" not in t
    assert m.eos_token_ids == (151329, 151336, 151338) and m.bos_token_id is None
    assert unloaded_prefixes(GLM45) == ("model.layers.92.",)


def test_glm45_air_and_the_rope_factor():
    m = ModelMetadata.from_config(dict(GLM45_AIR))
    assert not m.qk_norm and m.moe.sparse_layers[:2] == (False, True)
    # the rope dict's factor wins over the top level's; absent anywhere: 0.5
    dict_wins = {**GLM45, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                              "partial_rotary_factor": 0.25}}
    del dict_wins["rope_scaling"]
    assert ModelMetadata.from_config(dict_wins).variant.rotary_dim == 32
    absent = {k: v for k, v in GLM45.items() if k != "partial_rotary_factor"}
    assert ModelMetadata.from_config(absent).variant.rotary_dim == 64
    full = ModelMetadata.from_config({**GLM45, "partial_rotary_factor": 1.0})
    assert full.variant.rotary_dim == 0   # every dim: the plain rope
    # no head_dim: hidden_size // num_attention_heads, floored as HF does
    m = ModelMetadata.from_config({**{k: v for k, v in GLM45.items() if k != "head_dim"},
                                   "hidden_size": 4100, "num_attention_heads": 32})
    assert (m.head_dim, m.variant.rotary_dim) == (128, 64)


def test_glm47_flash_as_released():
    m = ModelMetadata.from_config(dict(GLM47_FLASH))
    a = m.mla
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.v_head_dim) == (768, 512, 256, 256)
    assert a.rope_pairs_adjacent and a.softmax_scale == 256 ** -0.5 and m.head_dim == 64
    r = m.moe.deepseek
    assert (r.scoring, r.n_group, r.routed_scaling_factor, m.moe.num_experts, m.moe.top_k) == \
        ("sigmoid", 1, pytest.approx(1.8), 64, 4)
    assert m.moe.sparse_layers[:2] == (False, True) and m.rms_norm_eps == 1e-5
    assert unloaded_prefixes(GLM47_FLASH) == ("model.layers.47.",)


def test_lite_class_defaults_and_head_dim_alias():
    m = ModelMetadata.from_config({"model_type": "glm4_moe_lite"})
    assert (m.num_layers, m.mla.q_lora_rank, m.mla.latent_dim, m.moe.num_experts,
            m.bos_token_id, m.eos_token_ids) == (47, 768, 576, 64, 0, (1,))
    assert m.moe.sparse_layers == (False,) + (True,) * 46
    alias = ModelMetadata.from_config({**GLM47_FLASH, "head_dim": 32, "qk_rope_head_dim": None})
    assert alias.mla.qk_rope_head_dim == 32
    types = ModelMetadata.from_config({**GLM47_FLASH, "first_k_dense_replace": 2,
                                       "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 45})
    assert types.moe.sparse_layers[:3] == (False, False, True)


@pytest.mark.parametrize("config", [GLM45, GLM45_AIR, GLM47_FLASH],
                         ids=["glm4.5", "glm4.5_air", "glm4.7_flash"])
def test_every_field_read_is_in_the_table(config):
    log = read_keys(dict(config), None)
    missing = sorted(f"{s}.{k}" for s, k in log if k not in FIELD_TABLE.get(s, {}))
    assert not missing
    # and every key of the released configs is documented
    assert not [k for k in config if k not in FIELD_TABLE[config["model_type"]]]


@pytest.mark.parametrize("change, error, words", [
    ({"quantization_config": {"quant_method": "fp8"}}, Unsupported, "quantization_config"),
    ({"topk_method": "greedy"}, Unsupported, "topk_method"),
    ({"scoring_func": "softmax"}, Unsupported, "scoring_func"),
    ({"moe_layer_freq": 2}, Unsupported, "moe_layer_freq"),
    ({"partial_rotary_factor": 0.4}, Unsupported, "partial_rotary_factor"),   # 51 dims
    ({"partial_rotary_factor": None}, FormatError, "partial_rotary_factor"),
    ({"partial_rotary_factor": 1.5}, FormatError, "partial_rotary_factor"),
    ({"head_dim": None}, FormatError, "head_dim"),
    ({"head_dim": 130}, Unsupported, "head_dim"),   # 130 * 0.5: an odd rotary count
    ({"head_dim": 512}, Unsupported, "head_dim"),
    ({"num_key_value_heads": 7}, FormatError, "num_key_value_heads"),
    ({"num_key_value_heads": None}, FormatError, "num_key_value_heads"),
    ({"n_group": 3}, FormatError, "n_group"),
    ({"n_group": 160}, FormatError, "top two"),
    ({"num_local_experts": 128}, FormatError, "n_routed_experts"),
    ({"hidden_act": "tanh"}, Unsupported, "hidden_act"),
])
def test_glm4_moe_refusals_name_the_field(change, error, words):
    with pytest.raises(error, match=words) as e:
        ModelMetadata.from_config({**GLM45, **change}, source="glm/config.json")
    assert "glm/config.json" in str(e.value)


@pytest.mark.parametrize("change, error, words", [
    ({"partial_rotary_factor": 0.5}, Unsupported, "partial_rotary_factor"),
    ({"first_k_dense_replace": 2}, Unsupported, "first_k_dense_replace"),
    ({"mlp_layer_types": ["dense", "moe"] + ["sparse"] * 45}, FormatError, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense"] * 3}, FormatError, "mlp_layer_types"),
    ({"head_dim": 32}, FormatError, "head_dim 32 and qk_rope_head_dim 64"),
    ({"head_dim": None}, FormatError, "head_dim"),
    ({"quantization_config": {"quant_method": "fp8"}}, Unsupported, "glm4_moe_lite"),
    ({"attention_bias": True}, Unsupported, "attention_bias"),
    ({"topk_method": "greedy"}, Unsupported, "topk_method"),
])
def test_glm4_moe_lite_refusals_name_the_field(change, error, words):
    with pytest.raises(error, match=words) as e:
        ModelMetadata.from_config({**GLM47_FLASH, **change}, source="flash/config.json")
    assert "flash/config.json" in str(e.value)


def test_refused_fields_are_marked():
    assert FIELD_TABLE["glm4_moe"]["quantization_config"].status == REFUSED
    assert FIELD_TABLE["glm4_moe_lite"]["first_k_dense_replace"].status == REFUSED
