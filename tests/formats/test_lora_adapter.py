"""PEFT LoRA adapters (formats/lora/): the fixtures' configs and tensors, PEFT's target and
pattern rules, and every refusal naming its field or tensor."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import FormatError, Unsupported
from metrale.formats import open_source
from metrale.formats.lora import parse_config, read_adapter, targeted
from tests.formats.st_util import tensors_bytes

FIX = Path(__file__).resolve().parents[1] / "fixtures"
LORA = FIX / "lora"


@pytest.fixture(scope="module")
def meta():
    return open_source(FIX / "qwen2").metadata()


def cfg(**over) -> dict:
    d = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
         "target_modules": ["q_proj"], "bias": "none"}
    d.update(over)
    return d


def names(c, meta) -> list[str]:
    return [m.name for m in targeted(parse_config(c, "adapter_config.json"), meta)]


def test_fixtures_read(meta):
    a = read_adapter(LORA / "qv_r8", meta)
    assert [m.name for m in a.modules] == [f"model.layers.{i}.self_attn.{p}_proj"
                                           for i in (0, 1) for p in "qv"]
    assert all(m.rank == 8 and m.scale == 2.0 and m.a.shape == (8, 64) for m in a.modules)
    assert a.modules[1].b.shape == (32, 8)            # v_proj: kv heads x head_dim
    rs = read_adapter(LORA / "all_r16_rslora", meta)
    assert len(rs.modules) == 14 and rs.kinds() == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"]
    assert all(m.scale == 32 / math.sqrt(16) for m in rs.modules)   # alpha / sqrt(r)
    p = {m.name: (m.rank, m.scale) for m in read_adapter(LORA / "pattern_r4", meta).modules}
    assert p["model.layers.0.self_attn.o_proj"] == (12, 8 / 12)        # rank_pattern
    assert p["model.layers.1.mlp.down_proj"] == (2, 8 / 2)             # layer-specific key
    assert p["model.layers.0.mlp.down_proj"] == (4, 2.0)
    assert p["model.layers.0.self_attn.k_proj"] == (4, 3 / 4)          # alpha_pattern
    assert p["model.layers.1.mlp.up_proj"] == (4, 20 / 4)
    one = read_adapter(LORA / "mlp_layer1_r64", meta)                  # layers_to_transform
    assert [m.name for m in one.modules] == ["model.layers.1.mlp.gate_proj",
                                             "model.layers.1.mlp.down_proj"]
    assert one.max_rank == 64


def test_peft_matching_rules(meta):
    # a list entry matches the name itself or a ".suffix"; a string is a fullmatch regex
    assert names(cfg(target_modules=["model.layers.1.self_attn.q_proj"]), meta) == \
        ["model.layers.1.self_attn.q_proj"]
    assert names(cfg(target_modules=["proj"]), meta) == []           # no partial suffix
    assert names(cfg(target_modules=r".*1\.self_attn\.[qk]_proj"), meta) == \
        ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    assert names(cfg(target_modules="q_proj"), meta) == []           # fullmatch, not search
    assert names(cfg(target_modules=["q_proj", "k_proj"], exclude_modules=["k_proj"]),
                 meta) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert names(cfg(target_modules=["q_proj"], exclude_modules=r".*0\..*"), meta) == \
        ["model.layers.1.self_attn.q_proj"]
    assert names(cfg(target_modules=["q_proj"], layers_to_transform=1,
                     layers_pattern="layers"), meta) == ["model.layers.1.self_attn.q_proj"]
    assert names(cfg(target_modules=["q_proj"], layers_to_transform=[0],
                     layers_pattern=["blocks"]), meta) == []
    assert len(names(cfg(target_modules="ALL-LINEAR"), meta)) == 14   # never the head


@pytest.mark.parametrize("over,text", [
    (dict(bias="all"), "bias"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "use_dora"), (dict(lora_bias=True), "lora_bias"),
    (dict(target_parameters=["experts.gate_up_proj"]), "target_parameters"),
    (dict(init_lora_weights="pissa"), "init_lora_weights"),
    (dict(loftq_config={"loftq_bits": 4}), "loftq_config"), (dict(r=257), "257"),
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern"), (dict(peft_type="IA3"), "peft_type"),
    (dict(task_type="SEQ_CLS"), "task_type"), (dict(layer_replication=[[0, 1]]),
                                               "layer_replication"),
    (dict(some_future_switch=True), "some_future_switch"),
    (dict(target_modules=["embed_tokens"]), "model.embed_tokens"),
    (dict(target_modules=["lm_head"]), "lm_head"),
])
def test_config_refusals_name_the_field(meta, over, text):
    with pytest.raises(Unsupported, match=text):
        names(cfg(**over), meta)


def test_unknown_default_fields_pass_and_missing_targets_fail(meta):
    assert names(cfg(some_future_field=None, other={}), meta)
    with pytest.raises(FormatError, match="target_modules"):
        parse_config({"peft_type": "LORA", "r": 4}, "x.json")


def test_moe_expert_and_router_targets_are_refused():
    moe = open_source("preset:tiny-moe").metadata()
    assert names(cfg(target_modules=["q_proj", "o_proj"]), moe)       # attention: served
    with pytest.raises(Unsupported, match="expert"):
        names(cfg(target_modules=["gate_proj"]), moe)
    with pytest.raises(Unsupported, match="router"):
        names(cfg(target_modules="all-linear"), moe)


@pytest.mark.parametrize("fixture", ["glm4_moe", "deepseek_v2"])
def test_deepseek_style_shared_experts_are_named_when_refused(fixture):
    # their `mlp.shared_experts.*` (no gate): an adapter on them is refused as what it is,
    # not as a target matching nothing
    moe = open_source(FIX / fixture).metadata()
    with pytest.raises(Unsupported, match="shared expert"):
        names(cfg(target_modules=r".*\.shared_experts\.(gate|up|down)_proj"), moe)


def _copy(tmp_path, name="qv_r8") -> Path:
    d = tmp_path / name
    shutil.copytree(LORA / name, d)
    return d


def _rewrite(d: Path, edit) -> None:
    from safetensors.numpy import load_file
    t = load_file(str(d / "adapter_model.safetensors"))
    edit(t)
    (d / "adapter_model.safetensors").write_bytes(
        tensors_bytes({k: ("F32", v) for k, v in t.items()}))


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_"


@pytest.mark.parametrize("edit,cls,text", [
    (lambda t: t.pop(KEY + "B.weight"), FormatError, "missing tensor.*q_proj.lora_B"),
    (lambda t: t.__setitem__(KEY + "A.weight", np.zeros((8, 63), np.float32)), FormatError,
     r"q_proj.lora_A.weight.*\[8, 63\].*\[8, 64\]"),
    (lambda t: t.__setitem__(KEY.replace("q_proj", "k_proj") + "A.weight",
                             np.zeros((8, 64), np.float32)), FormatError, "k_proj.*no module"),
    (lambda t: t.__setitem__(KEY.replace("lora_", "lora_magnitude_vector"),
                             np.zeros(64, np.float32)), Unsupported, "DoRA"),
    (lambda t: t.__setitem__("base_model.model.lm_head.weight", np.zeros((4, 4), np.float32)),
     Unsupported, "lm_head.weight"),
])
def test_tensor_checks_name_the_tensor(meta, tmp_path, edit, cls, text):
    d = _copy(tmp_path)
    _rewrite(d, edit)
    with pytest.raises(cls, match=text):
        read_adapter(d, meta)


def test_files(meta, tmp_path):
    d = _copy(tmp_path)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    with pytest.raises(FormatError, match="pickle"):
        read_adapter(d, meta)
    with pytest.raises(FormatError, match="adapter_config.json"):
        read_adapter(tmp_path, meta)
    (d / "adapter_config.json").write_text("{oops")
    with pytest.raises(FormatError, match="cannot read"):
        read_adapter(d, meta)


def test_rank_limit_and_base_shape(meta, tmp_path):
    with pytest.raises(Unsupported, match="rank 64.*max_lora_rank=16"):
        read_adapter(LORA / "mlp_layer1_r64", meta, max_rank=16)
    one_kv_head = dataclasses.replace(meta, num_kv_heads=1)   # v_proj: 16 outputs, not 32
    with pytest.raises(FormatError, match=r"v_proj.lora_B.weight.*\[32, 8\].*\[16, 8\]"):
        read_adapter(LORA / "qv_r8", one_kv_head)
    d = _copy(tmp_path, "pattern_r4")
    c = json.loads((d / "adapter_config.json").read_text())
    c["rank_pattern"] = {}                      # the o_proj tensors keep rank 12
    (d / "adapter_config.json").write_text(json.dumps(c))
    with pytest.raises(FormatError, match=r"o_proj.lora_A.weight.*\[12, 64\].*\[4, 64\]"):
        read_adapter(d, meta)
