"""Quantized checkpoints at load (formats/quant*.py): configs parsed field by field, every key
in the field table, and bad input refused before anything runs, by a FormatError /
Unsupported naming the file, the tensor and the field, with nothing left allocated."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import metrale
from metrale import FormatError, Unsupported
from metrale.formats import PRESETS, open_source, preset_config
from metrale.formats.field_table import FIELD_TABLE
from metrale.formats.quant.parse import parse_quantization
from metrale.formats.quant.rules import hf_converts
from metrale.formats.safetensors import SafetensorsFile
from metrale.gpu_runtime import HostBackend
from tests.model.common import FIXTURES

from .st_util import st_bytes

QUANT = ["q_fp8_block", "q_fp8_head", "q_ct_fp8_channel", "q_gptq_v1", "q_gptq_v2_actorder",
         "q_awq"]
_NP = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "I32": "<i4", "F8_E4M3": "u1", "I64": "<i8"}


def copy(tmp_path, name, config=None, tensors=None):
    """A copy of fixture `name`; config(q) edits its quantization_config, tensors(d) its
    tensors (name -> (dtype, array); None deletes)."""
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        with SafetensorsFile(dst / "model.safetensors") as f:
            d = {n: (t.dtype, np.array(f.raw(n))) for n, t in f.tensors.items()}
        tensors(d)
        header, chunks, off = {}, [], 0
        for n, (dt, arr) in d.items():
            b = np.ascontiguousarray(arr).astype(_NP[dt]).tobytes()
            header[n] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
            chunks.append(b)
            off += len(b)
        (dst / "model.safetensors").write_bytes(st_bytes(header, b"".join(chunks)))
    return dst


def refused(path, exc, *says):
    be = HostBackend()
    with pytest.raises(exc) as e:
        metrale.load(path, be, progress=False)
    for s in says:
        assert s in str(e.value), (s, str(e.value))
    assert be.live_bytes() == 0, "a refused load left device memory allocated"
    return str(e.value)


def put(name, fn):
    def edit(d):
        dt, a = d[name]
        d[name] = (dt, fn(a.copy()))
    return edit


# ------------------------------------------------------------------- bad tensors
@pytest.mark.parametrize("value", [np.nan, np.inf, 0.0, 1e-37])
def test_fp8_scales_must_be_finite_nonzero_and_not_tiny(tmp_path, value):
    t = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    path = copy(tmp_path, "q_fp8_block", tensors=put(t, lambda a: (a.__setitem__((1, 2), value), a)[1]))
    refused(path, FormatError, "model.safetensors", t, "weight_scale_inv", "[1, 2]",
            f"holds {str(np.float32(value))} at")   # the stored value, as plain digits


def test_int4_scales_must_be_finite_and_nonzero(tmp_path):
    t = "model.layers.1.self_attn.o_proj.scales"
    path = copy(tmp_path, "q_gptq_v1", tensors=put(t, lambda a: (a.__setitem__((0, 3), 0), a)[1]))
    refused(path, FormatError, "model.safetensors", t, "scales", "holds 0.0 at [0, 3]")


def test_wrong_shape_scales(tmp_path):
    t = "model.layers.0.mlp.up_proj.weight_scale_inv"
    path = copy(tmp_path, "q_fp8_block", tensors=put(t, lambda a: a[:, :-1]))
    refused(path, FormatError, "model.safetensors", t, "has shape [3, 2]",
            "quantization_config implies [3, 3]")
    t = "model.layers.0.mlp.down_proj.scales"
    path = copy(tmp_path / "b", "q_awq", config=lambda q: q.update(modules_to_not_convert=[]),
                tensors=lambda d: d.update({t: ("F16", np.ones((2, 128), np.float16))}))
    refused(path, FormatError, "missing tensor 'model.layers.0.mlp.down_proj.qweight'")


def test_wrong_dtype(tmp_path):
    t = "model.layers.0.self_attn.q_proj.qzeros"
    path = copy(tmp_path, "q_gptq_v1",
                tensors=lambda dd: dd.update({t: ("F32", dd[t][1].astype(np.float32))}))
    refused(path, FormatError, t, "dtype F32", "expected I32")


def test_group_size_must_divide_the_input_dimension(tmp_path):
    path = copy(tmp_path, "q_gptq_v1", config=lambda q: q.update(group_size=48))
    refused(path, FormatError, "config.json", "model.safetensors", "group_size 48 does not "
            "divide the input dimension 128", "model.layers.0.self_attn.q_proj")


def test_quantized_tensors_of_a_module_left_unquantized(tmp_path):
    path = copy(tmp_path, "q_awq", config=lambda q: q.update(
        modules_to_not_convert=["mlp.down_proj", "self_attn.o_proj"]))
    refused(path, FormatError, "model.safetensors", "self_attn.o_proj.", "is quantized",
            "modules_to_not_convert leaves model.layers.0.self_attn.o_proj unquantized")
    path = copy(tmp_path / "b", "q_fp8_block", config=lambda q: q.update(
        modules_to_not_convert=["lm_head", "k_proj", "o_proj"]))
    refused(path, FormatError, "model.layers.0.self_attn.o_proj.", "modules_to_not_convert")
    path = copy(tmp_path / "c", "q_ct_fp8_channel", config=lambda q: q.update(
        ignore=["lm_head", "re:.*mlp\\.up_proj$"]))
    refused(path, FormatError, "mlp.up_proj.", "quantization_config.ignore")


def test_gptq_v1_zero_point_nibble_15_is_refused(tmp_path):
    t = "model.layers.1.mlp.gate_proj.qzeros"
    path = copy(tmp_path, "q_gptq_v1", tensors=put(t, lambda a: a | np.int32(0xF0)))
    refused(path, FormatError, "model.safetensors", t, "nibble 15", "checkpoint_format 'gptq'")


def test_g_idx(tmp_path):
    path = copy(tmp_path, "q_gptq_v2_actorder", config=lambda q: q.update(desc_act=False))
    refused(path, FormatError, "self_attn.q_proj.g_idx", "desc_act is false")
    t = "model.layers.0.self_attn.q_proj.g_idx"
    path = copy(tmp_path / "b", "q_gptq_v2_actorder", tensors=put(t, lambda a: a + 1))
    refused(path, FormatError, t, "outside [0, 4)")


def test_unused_tensors_such_as_static_activation_scales(tmp_path):
    t = "model.layers.0.self_attn.q_proj.input_scale"
    path = copy(tmp_path, "q_fp8_head",
                tensors=lambda d: d.update({t: ("F32", np.ones((), np.float32))}))
    refused(path, FormatError, t, "static activation scales are not supported")


def test_a_tied_head_the_config_would_quantize(tmp_path):
    path = copy(tmp_path, "q_ct_fp8_channel", config=lambda q: q.update(ignore=[]))
    refused(path, Unsupported, "quantizes lm_head, which is tied")


# ----------------------------------------------------------------- refused fields
REFUSED = [
    ("q_fp8_block", {"activation_scheme": "static"}, "activation_scheme = 'static'"),
    ("q_fp8_block", {"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ("q_fp8_block", {"modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    ("q_fp8_block", {"made_up_field": 1}, "field 'made_up_field' is not known"),
    ("q_gptq_v1", {"bits": 3}, "bits = 3"),
    ("q_gptq_v1", {"bits": 8}, "bits = 8"),
    ("q_gptq_v1", {"checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ("q_gptq_v1", {"lm_head": True}, "lm_head = True"),
    ("q_gptq_v1", {"dynamic": {"-:.*": {}}}, "dynamic"),
    ("q_gptq_v1", {"is_marlin_format": True}, "is_marlin_format = True"),
    ("q_awq", {"version": "gemv"}, "version = 'gemv'"),
    ("q_awq", {"zero_point": False}, "zero_point = False"),
    ("q_awq", {"bits": 8}, "bits = 8"),
    ("q_ct_fp8_channel", {"format": "pack-quantized"}, "format = 'pack-quantized'"),
    ("q_ct_fp8_channel", {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ("q_ct_fp8_channel", {"quantization_status": "frozen"}, "quantization_status"),
]


@pytest.mark.parametrize("name,update,says", REFUSED)
def test_refused_fields_name_the_field_and_value(tmp_path, name, update, says):
    path = copy(tmp_path, name, config=lambda q: q.update(update))
    refused(path, Unsupported, str(path / "config.json"), says)


def test_compressed_tensors_static_activations_are_refused(tmp_path):
    def static(q):
        q["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    path = copy(tmp_path, "q_ct_fp8_channel", config=static)
    refused(path, Unsupported, "input_activations", "static activation quantization")


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "torchao", "mxfp4", None])
def test_other_methods_are_refused_by_name(method):
    with pytest.raises(Unsupported, match=f"quant_method = {method!r}"):
        parse_quantization({"quantization_config": {"quant_method": method}}, "config.json")


# ------------------------------------------------------------------- the rules
def test_every_quantization_field_of_the_fixtures_and_presets_is_in_the_table():
    configs = [json.loads((FIXTURES / n / "config.json").read_text())["quantization_config"]
               for n in QUANT]
    configs += [preset_config(p)[0]["quantization_config"] for p in PRESETS
                if "quantization_config" in PRESETS[p]]
    for q in configs:
        scope = f"quantization_config.{q['quant_method']}"
        assert set(q) <= set(FIELD_TABLE[scope]), set(q) - set(FIELD_TABLE[scope])
        for g in q.get("config_groups", {}).values():
            assert set(g) <= set(FIELD_TABLE[f"{scope}.scheme"])
            for part in ("weights", "input_activations"):
                if g.get(part):
                    assert set(g[part]) <= set(FIELD_TABLE[f"{scope}.args"])


def test_transformers_module_rule():
    # a pattern skips from the start up to a module boundary, as a regex, or as a suffix
    assert not hf_converts("lm_head", ("lm_head",))
    assert not hf_converts("model.layers.1.mlp.down_proj", ("model.layers.1",))
    assert hf_converts("model.layers.11.mlp.down_proj", ("model.layers.1",))
    assert not hf_converts("model.layers.11.mlp.down_proj", (r"model.layers.\d+.mlp",))
    assert not hf_converts("model.layers.3.self_attn.k_proj", ("k_proj",))
    assert hf_converts("model.layers.3.mlp.gate_proj", ("mlp.gate",))


def test_configs_describe_themselves():
    for name in QUANT:
        q = open_source(FIXTURES / name).metadata().quantization
        assert q.method in q.describe() or q.method.upper() in q.describe()


# ------------------------------------------------------- FP8 scales as releases store them
@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_fp8_weight_scale_inv_in_bf16_or_f16_loads_as_its_values(tmp_path, dtype):
    """Fine-grained FP8 releases store weight_scale_inv in float32, bfloat16 or float16: each
    widens exactly to the float32 the dequantization multiplies by, so a checkpoint whose
    scales are stored BF16 / F16 gives the bits of the same scales stored F32."""
    from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
    from tests.model.common import golden, logits_rows
    scales = {}

    def as_f32(d):   # every scale rounded to a BF16 value (8 bits: FP16 holds it too)
        for n, (dt, a) in d.items():
            if n.endswith("weight_scale_inv"):
                scales[n] = bf16_to_f32(f32_to_bf16(a.astype(np.float32)))
                d[n] = ("F32", scales[n])

    def stored(d):
        as_f32(d)
        for n, v in scales.items():
            d[n] = (dtype, f32_to_bf16(v) if dtype == "BF16" else v.astype(np.float16))
            assert np.array_equal(bf16_to_f32(d[n][1]) if dtype == "BF16"
                                  else d[n][1].astype(np.float32), v)
    ref = copy(tmp_path / "f32", "q_fp8_block", tensors=as_f32)
    got = copy(tmp_path / "low", "q_fp8_block", tensors=stored)
    ids = golden("q_fp8_block")["input_ids"][0, :10].tolist()
    rows = []
    for path in (ref, got):
        m = metrale.load(path, HostBackend(), progress=False)
        seq = m.alloc_sequence()
        rows.append(logits_rows(m, m.prefill(ids, seq, 0)))
        m.teardown()
    assert np.array_equal(rows[0], rows[1])
