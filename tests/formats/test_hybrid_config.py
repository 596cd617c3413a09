"""The hybrid families' config.json (formats/hybrid_config.py): defaults as transformers
resolves them, and every value the kernels or the model do not implement refused by name."""
import copy
import json

import numpy as np
import pytest

from metrale import FormatError, Unsupported
from metrale.formats import ModelMetadata, open_source
from metrale.model_engine.hybrid import check_hybrid_checkpoint
from tests.formats.st_util import write_checkpoint
from tests.model.common import FIXTURES


def cfg(name="qwen3_5_text"):
    return json.loads((FIXTURES / name / "config.json").read_text())


def parse(c):
    return ModelMetadata.from_config(c, source="config.json")


def test_defaults_as_transformers_resolves_them():
    c = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32,
         "num_attention_heads": 4, "num_hidden_layers": 8}
    m = parse(c)
    hy = m.hybrid
    assert hy.layer_types == ("linear_attention",) * 3 + ("full_attention",) + \
        ("linear_attention",) * 3 + ("full_attention",)        # full_attention_interval 4
    assert (m.head_dim, m.num_kv_heads, hy.rotary_dim) == (256, 2, 64)   # 0.25 of 256
    g = hy.gdn
    assert (g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim, g.conv_kernel) == \
        (16, 32, 128, 128, 4) and g.fused_projections
    assert (m.moe.num_experts, m.moe.top_k, m.moe.norm_topk_prob) == (512, 10, True)
    assert m.max_position_embeddings == 32768 and not m.tie_word_embeddings
    five = parse({**c, "model_type": "qwen3_5_text"})
    assert five.moe is None and five.num_kv_heads == 4 and not five.hybrid.gdn.fused_projections


def test_qwen3_5_wrapper_reads_its_text_config():
    m = parse(cfg("qwen3_5_vl"))
    assert m.architecture == "qwen3_5" and m.hybrid.text_config_key == "text_config"
    assert m.tie_word_embeddings and m.hybrid.layer_types[-1] == "full_attention"
    src = open_source(FIXTURES / "qwen3_5_vl")
    names = src.tensor_names()
    assert "model.layers.0.linear_attn.A_log" in names          # model.language_model.* read
    assert any(n.startswith("model.visual.") for n in names) and "mtp.fc.weight" in names
    check_hybrid_checkpoint(src, src.metadata())               # both skipped by name


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c.update(attention_bias=True), Unsupported, "attention_bias"),
    (lambda c: c.update(hidden_act="gelu"), Unsupported, "hidden_act='gelu'.*conv"),
    (lambda c: c.update(linear_key_head_dim=24), Unsupported, "linear_key_head_dim 24"),
    (lambda c: c.update(linear_value_head_dim=48), Unsupported, "linear_value_head_dim 48"),
    (lambda c: c.update(linear_conv_kernel_dim=5), Unsupported, "linear_conv_kernel_dim 5"),
    (lambda c: c.update(linear_num_value_heads=3), FormatError, "multiple of"),
    (lambda c: c.update(layer_types=["linear_attention"] * 4), FormatError, "layer_types"),
    (lambda c: c.update(layer_types=["mamba"] * 5), Unsupported, "'mamba'"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.01), Unsupported,
     "rotary dims"),
    (lambda c: c.update(quantization_config={"quant_method": "gptq"}), Unsupported,
     "quantization_config"),
])
def test_values_the_model_does_not_implement_are_refused(edit, error, match):
    c = cfg()
    edit(c)
    with pytest.raises(error, match=match):
        parse(c)


def test_wrapper_refusals():
    c = cfg("qwen3_5_vl")
    bad = copy.deepcopy(c)
    bad["text_config"]["model_type"] = "qwen3_next"
    with pytest.raises(Unsupported, match="text_config.model_type 'qwen3_next'"):
        parse(bad)
    bad = copy.deepcopy(c)
    bad["text_config"]["tie_word_embeddings"] = False
    with pytest.raises(FormatError, match="tie_word_embeddings is True at the top level"):
        parse(bad)
    bad = copy.deepcopy(c)
    del bad["text_config"]
    with pytest.raises(FormatError, match="text_config"):
        parse(bad)


def test_a_tensor_nobody_reads_is_refused(tmp_path):
    orig = open_source(FIXTURES / "qwen3_5_text")
    t = {n: np.asarray(orig.read_bf16(n)) for n in orig.tensor_names()}
    t["model.layers.0.linear_attn.extra.weight"] = t["model.norm.weight"]
    src = open_source(write_checkpoint(tmp_path / "ck", cfg(), t))
    with pytest.raises(FormatError, match="linear_attn.extra.weight"):
        check_hybrid_checkpoint(src, src.metadata())
