"""config.json counts and sizes far beyond the checkpoint's tensors are refused naming
config.json and the key before anything is sized by them (formats/config_bounds.py), and a
wrong size within them by the tensor check, which runs before the memory plan."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import metrale
from metrale.errors import FormatError
from metrale.formats import open_source
from metrale.gpu_runtime import HostBackend

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def copy(tmp_path, name: str, changes: dict, sub: str | None = None) -> Path:
    """Fixture checkpoint `name` with config.json keys changed (in sub-config `sub`)."""
    d = tmp_path / name
    d.mkdir()
    for f in (FIXTURES / name).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, d / f.name)
        elif f.suffix == ".safetensors":
            os.symlink(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    (cfg[sub] if sub else cfg).update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


COUNTS = [
    ("llama_gqa", None, "num_hidden_layers",
     "num_hidden_layers = 1000000000 but the checkpoint holds tensors for 2 layers "
     "(model.layers.0 .. model.layers.1)"),
    ("qwen3_moe", None, "num_hidden_layers", "num_hidden_layers = 1000000000"),
    ("llava_tiny", "text_config", "num_hidden_layers",
     "text_config.num_hidden_layers = 1000000000 but the checkpoint holds tensors for 2 "
     "layers (language_model.model.layers.0 .. language_model.model.layers.1)"),
    ("llava_tiny", "vision_config", "num_hidden_layers",
     "vision_config.num_hidden_layers = 1000000000"),
    ("whisper_tiny", None, "encoder_layers", "encoder_layers = 1000000000"),
    ("whisper_tiny", None, "decoder_layers", "decoder_layers = 1000000000"),
]


@pytest.mark.parametrize("name, sub, key, named", COUNTS,
                         ids=[f"{c[0]}-{c[1] or ''}{c[2]}" for c in COUNTS])
def test_layer_counts_beyond_the_tensors_are_refused_before_parsing(tmp_path, name, sub,
                                                                    key, named):
    """10**9 layers used to build per-layer tuples (layer windows, the layout): MemoryError."""
    d = copy(tmp_path, name, {key: 10**9}, sub)
    with pytest.raises(FormatError) as e:
        open_source(d).metadata()
    assert str(d / "config.json") in str(e.value) and named in str(e.value)


SIZES = [
    ("llama_gqa", {"hidden_size": 10**9}, "hidden_size = 1000000000"),
    ("llama_gqa", {"intermediate_size": 10**9}, "intermediate_size = 1000000000"),
    ("llama_gqa", {"vocab_size": 10**9}, "vocab_size = 1000000000"),
    ("llama_gqa", {"num_attention_heads": 10**6},
     "num_attention_heads = 1000000 (x head_dim 16) = 16000000"),
    ("q_gptq_v1", {"intermediate_size": 10**9}, "intermediate_size = 1000000000"),
    ("qwen2_moe", {"moe_intermediate_size": 10**9}, "moe_intermediate_size = 1000000000"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 10**9},
     "shared_expert_intermediate_size = 1000000000"),
]


@pytest.mark.parametrize("name, changes, named", SIZES,
                         ids=[f"{s[0]}-{next(iter(s[1]))}" for s in SIZES])
def test_sizes_beyond_every_tensor_are_refused_by_key(tmp_path, name, changes, named):
    """They used to reach the memory plan: 'needs 13056010483460 bytes ... lower
    kv_blocks', naming no key."""
    d = copy(tmp_path, name, changes)
    with pytest.raises(FormatError) as e:
        metrale.load(d, "cpu", progress=False)
    msg = str(e.value)
    assert str(d / "config.json") in msg and named in msg
    assert "no tensor of the checkpoint is that long" in msg


def test_an_unused_intermediate_size_is_not_bounded(tmp_path):
    """qwen2_moe with every layer sparse never reads intermediate_size (HF neither)."""
    d = copy(tmp_path, "qwen2_moe", {"intermediate_size": 10**9})
    assert open_source(d).metadata().intermediate_size == 10**9


def test_a_wrong_size_within_the_tensors_is_refused_before_the_memory_plan(tmp_path):
    """intermediate_size 256 (the checkpoint's is 128) is no longer than its longest tensor
    dimension; the tensor check names the tensor before a plan sized by it (on a backend
    with no free memory the plan would fail first, naming no tensor)."""
    d = copy(tmp_path, "llama_gqa", {"intermediate_size": 256})
    backend = HostBackend()
    backend.free_memory = lambda: 0
    with pytest.raises(FormatError, match=r"mlp\.gate_proj\.weight' has shape \[128, 64\]"):
        metrale.load(d, backend, progress=False)
