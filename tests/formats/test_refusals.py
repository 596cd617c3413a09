"""What metrale does not implement is refused at load, never run differently: a config
value the field table marks as refused raises `Unsupported` naming the file, the field and
the value; a checkpoint tensor no code reads raises `FormatError` naming it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import metrale
from metrale import FormatError, InvalidArgument, Unsupported
from metrale.formats import DirectorySource
from metrale.gpu_runtime import HostBackend
from tests.model.common import FIXTURES, golden, load, logits_rows

from .st_util import write_checkpoint


def _copy(tmp_path, name, edit=None):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(**kv):
    return lambda cfg: cfg.update(kv)


def _nested_rope(cfg):
    cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


REFUSED = [
    # (fixture, edit, the field and value the message names)
    ("llama_gqa", _set(hidden_act="gelu_10"), "hidden_act='gelu_10'"),
    ("qwen2", _set(hidden_act="relu2"), "hidden_act='relu2'"),
    ("llama_gqa", _set(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
     "quantization_config.quant_method = 'bitsandbytes'"),
    ("llama_gqa", _set(quantization_config={"quant_method": "gptq", "bits": 8}),
     "quantization_config.bits = 8"),
    ("llama_mqa_tied", _set(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                             "short_factor": [1.0], "long_factor": [1.0],
                                             "original_max_position_embeddings": 64}),
     "rope type 'longrope'"),
    ("llama_mqa_tied", _set(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    ("qwen3_window_layer_types", _set(layer_types=["chunked_attention", "full_attention"]),
     "layer_types value 'chunked_attention'"),
    ("qwen3_window_layer_types", _set(use_sliding_window=False),
     "layer_types has 'sliding_attention' layers but use_sliding_window=False"),
    ("qwen2_window_max_window_layers", _nested_rope, "per-layer-type rope_parameters"),
    ("mistral", _set(dtype="int8"), "dtype 'int8'"),
    ("llava_tiny", _set(vision_feature_layer=[-2, -1]), "vision_feature_layer must be one int"),
]


@pytest.mark.parametrize("name, edit, says", REFUSED,
                         ids=[f"{n}-{s.split('=')[0].split(' ')[0]}" for n, _, s in REFUSED])
def test_refused_field_raises_unsupported_at_load(tmp_path, name, edit, says):
    path = _copy(tmp_path, name, edit)
    with pytest.raises(Unsupported, match=f"{path / 'config.json'}.*{says}"):
        metrale.load(path, HostBackend(), progress=False)


def test_irrelevant_field_changes_nothing(tmp_path):
    """mistral's modeling never reads attention_bias (nor llama's sliding_window): the same
    checkpoint loads and gives the same logits with them set."""
    g = golden("mistral")
    ids = g["input_ids"][0].tolist()
    base = logits_rows(m := load("mistral"), m.prefill(ids, m.alloc_sequence(), 0))
    for name, edit in (("mistral", _set(attention_bias=True, mlp_bias=True)),
                       ("llama_gqa", _set(sliding_window=3, use_sliding_window=True))):
        path = _copy(tmp_path, name, edit)
        m2 = metrale.load(path, HostBackend(), progress=False)
        got = logits_rows(m2, m2.prefill(ids, m2.alloc_sequence(), 0))
        if name == "mistral":
            assert np.array_equal(got, base)
        else:
            assert not any(m2.metadata().layer_windows)


def test_unused_tensor_is_refused_naming_it(tmp_path):
    """A bias that mistral's modeling code would never read (the o_proj.bias of the issue)."""
    src = DirectorySource(FIXTURES / "mistral")
    tensors = {n: np.array(src.read_bf16(n)) for n in src.tensor_names()}
    tensors["model.layers.1.self_attn.o_proj.bias"] = np.zeros(64, np.uint16)
    tensors["model.layers.0.rotary_emb.inv_freq"] = np.zeros(8, np.uint16)   # harmless
    path = write_checkpoint(tmp_path / "m", src.config(), tensors)
    with pytest.raises(FormatError, match=r"model.safetensors: 1 tensor\(s\) that no part of "
                                          r"the model uses: model.layers.1.self_attn.o_proj.bias"):
        metrale.load(path, HostBackend(), progress=False)
    del tensors["model.layers.1.self_attn.o_proj.bias"]
    path = write_checkpoint(tmp_path / "ok", src.config(), tensors)
    metrale.load(path, HostBackend(), progress=False).teardown()   # only the harmless one


def test_dynamic_rope_refuses_positions_past_its_limit():
    m = load("llama_dynamic_rope")
    assert m.metadata().context_length == 32 and m.metadata().rope_scaling.rope_type == "dynamic"
    seq = m.alloc_sequence()
    m.prefill(list(range(4, 36)), seq, 0)          # positions 0..31: the default rope, as HF
    with pytest.raises(InvalidArgument, match="max_seq_len=32 \\(rope type 'dynamic'"):
        m.decode(5, seq, 0)


@pytest.mark.parametrize("name,edit", [
    ("llama_gqa", _set(hidden_act=[])),                    # found by the config fuzzer
    ("llama_gqa", _set(hidden_act={"name": "silu"})),
    ("qwen2", _set(use_sliding_window=True, sliding_window=4,
                   layer_types=[["sliding_attention"], "full_attention"])),
])
def test_malformed_values_are_refused_not_crashed(tmp_path, name, edit):
    with pytest.raises(metrale.MetraleError):
        metrale.load(_copy(tmp_path, name, edit), HostBackend(), progress=False)
