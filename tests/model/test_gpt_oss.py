"""gpt-oss's MXFP4 experts (as released) beyond the golden suite (test_golden.py runs
gpt_oss and gpt_oss_mxfp4 through every forward path on cpu and emu): the packed experts
give exactly the bits of the BF16 model of their dequantized values (the dequantization is
exact), are held at their bytes (0.27x of BF16), and what is malformed is refused by name
before anything is uploaded."""
import json
import shutil

import numpy as np
import pytest

import metrale
from metrale.errors import FormatError, Unsupported
from metrale.formats.metadata import ModelMetadata
from metrale.gpu_runtime import HostBackend, backend
from metrale.ops.mxfp4 import dequant_bf16
from tests.conftest import emu_available
from tests.formats.st_util import tensors_bytes
from tests.model.common import FIXTURES, golden, logits_rows

NAME = "gpt_oss_mxfp4"
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def _read(path):
    from metrale.formats.safetensors import SafetensorsFile
    f = SafetensorsFile(path)
    return {n: (f.info(n).dtype, np.array(f.raw(n))) for n in f.tensors}


def dequantized_copy(tmp_path):
    """The checkpoint with its experts as BF16 tensors of the dequantized values, in
    transformers' layout ([E, k, n]), and no quantization_config."""
    d = tmp_path / "bf16"
    shutil.copytree(FIXTURES / NAME, d)
    t = _read(d / "model.safetensors")
    out = {}
    for n, (dt, a) in t.items():
        if n.endswith("_scales"):
            continue
        if n.endswith("_blocks"):
            base = n[:-len("_blocks")]
            E, rows, g, _ = a.shape
            w = dequant_bf16(a.reshape(E, rows, g * 16), t[base + "_scales"][1])
            out[base] = ("BF16", np.ascontiguousarray(w.transpose(0, 2, 1)))
        else:
            out[n] = (dt, a)
    (d / "model.safetensors").write_bytes(tensors_bytes(out))
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run(m, ids):
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:9], seq, s))[0]]
    rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in ids[9:]]
    return np.stack(rows)


@pytest.mark.parametrize("device_name", BACKENDS)
def test_mxfp4_experts_are_the_bf16_model_of_their_values_bit_for_bit(tmp_path, device_name):
    be = backend(device_name)
    ids = golden(NAME)["input_ids"][0].tolist()
    packed = metrale.load(FIXTURES / NAME, be, progress=False)
    plain = metrale.load(dequantized_copy(tmp_path), be, progress=False)
    assert np.array_equal(run(packed, ids), run(plain, ids))


def test_mxfp4_weights_are_held_at_their_bytes():
    m = metrale.load(FIXTURES / NAME, HostBackend(), progress=False)
    bf16 = metrale.load(FIXTURES / "gpt_oss", HostBackend(), progress=False)
    meta = m.metadata()
    E, h, i = meta.moe.num_experts, meta.hidden_size, meta.moe.expert_intermediate_size
    experts_bf16 = meta.num_layers * E * 3 * h * i * 2
    experts_mx = meta.num_layers * E * 3 * h * i * (4 + 8 / 32) / 8
    assert experts_mx / experts_bf16 == pytest.approx(0.2656, abs=1e-4)
    assert bf16.weight_bytes() - m.weight_bytes() == experts_bf16 - experts_mx
    assert m._weights.nbytes == m.weight_bytes()


def _copy(tmp_path, edit_cfg=None, edit_tensors=None):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / NAME, d)
    if edit_cfg:
        cfg = json.loads((d / "config.json").read_text())
        edit_cfg(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = _read(d / "model.safetensors")
        edit_tensors(t)
        (d / "model.safetensors").write_bytes(tensors_bytes(t))
    return d


def _scale(t, v):
    dt, a = t["model.layers.1.mlp.experts.down_proj_scales"]
    a = a.copy()
    a[2, 5, 0] = v
    t["model.layers.1.mlp.experts.down_proj_scales"] = (dt, a)


@pytest.mark.parametrize("edit_cfg,edit_tensors,err,match", [
    (lambda c: c["quantization_config"].update(quant_method="fp8"), None, Unsupported,
     "quant_method 'fp8'"),
    (lambda c: c["quantization_config"].update(group_size=32), None, Unsupported,
     "group_size"),
    (lambda c: c["quantization_config"]["modules_to_not_convert"].append(
        "model.layers.*.mlp.experts"), None, Unsupported, "modules_to_not_convert"),
    (None, lambda t: _scale(t, 255), FormatError, "down_proj_scales.*scale byte 255"),
    (None, lambda t: _scale(t, 1), FormatError, "scale byte 1"),
    (None, lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_scales": (
        "BF16", np.zeros((4, 64, 2), np.uint16))}), FormatError, "gate_up_proj_scales.*U8"),
    (None, lambda t: t.pop("model.layers.0.mlp.experts.down_proj_blocks"), FormatError,
     "missing tensor .*down_proj_blocks"),
])
def test_bad_mxfp4_checkpoints_are_refused_by_name(tmp_path, edit_cfg, edit_tensors, err,
                                                   match):
    d = _copy(tmp_path, edit_cfg, edit_tensors)
    be = HostBackend()
    with pytest.raises(err, match=match):
        metrale.load(d, be, progress=False)
    assert be.live_bytes() == 0


def test_default_rope_and_layer_types_as_transformers_fills_them():
    """No rope keys: HF's yarn (factor 32 over 4096 positions, untruncated, base 150000);
    no layer_types: every other layer slides, from layer 0."""
    cfg = json.loads((FIXTURES / "gpt_oss" / "config.json").read_text())
    for k in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types"):
        cfg.pop(k, None)
    cfg["num_hidden_layers"] = 4
    m = ModelMetadata.from_config(cfg)
    rs = m.rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings, rs.truncate,
            m.rope_theta) == ("yarn", 32.0, 4096, False, 150000.0)
    assert m.layer_windows == (5, 0, 5, 0)
