"""`metrale info`: the context metrale runs, the parameters it reads and every field that
changes the math (rope, windows per layer, biases, activation, tied head, dtype)."""
import json

import numpy as np

from metrale.cli import main
from metrale.formats import DirectorySource
from tests.formats.st_util import write_checkpoint
from tests.model.common import FIXTURES


def info(capsys, *args):
    assert main(["info", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_math_fields_are_shown(capsys):
    out = info(capsys, FIXTURES / "qwen2_window_max_window_layers")
    assert "full attention on layer 0, window 5 on layer 1" in out
    assert "biases         q/k/v\n" in out
    out = info(capsys, FIXTURES / "qwen3_attention_bias")
    assert "biases         q/k/v, o_proj" in out and "RMSNorm on each q/k head" in out
    assert "gate/up/down" in info(capsys, FIXTURES / "llama_mlp_bias")
    assert "activation     gelu_pytorch_tanh" in info(capsys, FIXTURES / "llama_gelu_pytorch_tanh")
    out = info(capsys, FIXTURES / "llama_gqa")
    assert "llama3, factor 8, low/high freq factor 1/4, original context 64, theta 500000" in out
    assert "dynamic NTK, factor 2" in info(capsys, FIXTURES / "llama_dynamic_rope")
    assert "tied, but the checkpoint stores its own head" in \
        info(capsys, FIXTURES / "llama_tied_stored_head")
    assert "tied: lm_head = input embedding" in info(capsys, FIXTURES / "llama_mqa_tied")


def test_context_and_parameters(capsys):
    d = json.loads(info(capsys, FIXTURES / "llama_dynamic_rope", "--json"))
    assert d["context_length"] == 32 and d["rope_type"] == "dynamic"
    src = DirectorySource(FIXTURES / "llama_tied_stored_head")
    d = json.loads(info(capsys, FIXTURES / "llama_tied_stored_head", "--json"))
    # every stored tensor is used here, the head included
    assert d["parameters"] == sum(int(np.prod(src.tensor_shape(n))) for n in src.tensor_names())
    assert d["parameters"] == 128 * 32 * 2 + 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64
                                                  + 64) + 32
    yarn = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 1024}}
    from metrale.formats import MemorySource
    src = MemorySource.from_config(yarn)
    tensors = {n: src.read_bf16(n) for n in src.tensor_names()}
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as t:
        path = write_checkpoint(Path(t) / "y", yarn, tensors, shards=2)
        out = info(capsys, path)
    assert "context        4,096 positions (max_position_embeddings 1,024, scaled" in out
    assert "F32 rounded to nearest even BF16" in out


def test_info_presets_lists_every_preset_and_the_readme_names_them(capsys):
    """A command lists the presets and the README names every one (issue 44: the list was
    incomplete and no command listed them)."""
    from pathlib import Path

    from metrale.cli import main
    from metrale.formats import PRESETS
    assert main(["info", "--presets"]) == 0
    out = capsys.readouterr().out
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("preset:")]
    assert listed == [f"preset:{n}" for n in PRESETS]
    assert main(["info", "--presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    moe = next(r for r in rows if r["name"] == "qwen3-30b-a3b")
    assert moe["active_parameters"] < moe["parameters"] and moe["architecture"] == "qwen3_moe"
    assert next(r for r in rows if r["name"] == "qwen2.5-0.5b-gptq")["quantization"] == "gptq"
    assert main(["info", "--presets", "preset:tiny"]) == 2
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Command line"):readme.index("```bash", readme.index(
        "## Command line"))]
    missing = [n for n in PRESETS if f"`{n}`" not in section]
    assert not missing, missing
