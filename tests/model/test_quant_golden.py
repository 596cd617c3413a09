"""Quantized checkpoints end to end (issue 24): each quantized fixture against its golden (HF
fp32 on the dequantized weights) through the pointer and tensor APIs, on HostBackend and on
the emulator; bit for bit the BF16 model of the dequantized weights; batch invariance; and
each honoured field shown to matter (the golden differs from the model that ignores it)."""
import json
import shutil

import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.formats import open_source
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend, backend
from metrale.model_engine.linear import Fp8Linear, Q4Linear
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, logits_rows, rel_err

QUANT_FIXTURES = ["q_fp8_block", "q_fp8_head", "q_ct_fp8_channel", "q_gptq_v1",
                  "q_gptq_v2_actorder", "q_awq"]
EMU = pytest.param("emu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not emu_available(), reason="no C++ compiler")])


def load(src, be=None, **kw):
    return metrale.load(src, be or HostBackend(), progress=False, **kw)


def run_prompt(m, ids, decode_from: int):
    """Logits rows: the prefill of ids[:decode_from], then one decode per later token."""
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:decode_from], seq, s))[0]]
    for t in ids[decode_from:]:
        rows.append(logits_rows(m, m.decode(t, seq, s))[0])
    m.free_sequence(seq)
    return np.stack(rows)


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", QUANT_FIXTURES)
def test_matches_golden_and_the_dequantized_bf16_model_bit_for_bit(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    be = backend(device_name)
    m = load(FIXTURES / name, be)
    kinds = {type(L.qkv).__name__ for L in m._weights.layers} | \
        {type(L.gate_up).__name__ for L in m._weights.layers}
    assert kinds & {"Q4Linear", "Fp8Linear"}, f"{name}: nothing stayed quantized ({kinds})"
    got = run_prompt(m, ids[:20], 12)
    assert_matches_golden(got, g["logits"][11:20], f"{name} on {device_name}")
    ref = load(DequantizedSource(open_source(FIXTURES / name)), be)
    assert ref._meta.quantization is None
    assert np.array_equal(got, run_prompt(ref, ids[:20], 12)), \
        f"{name}: the quantized model differs from its dequantized BF16 model"


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", ["q_fp8_head", "q_gptq_v2_actorder", "q_awq"])
def test_decode_batch_rows_equal_solo_steps(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(FIXTURES / name, backend(device_name))
    s = m.default_stream()
    lens = [3, 11, 1, 18]
    seqs = []
    for n in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:n], seq, s)
        seqs.append(seq)
    batch = logits_rows(m, m.decode_batch([ids[n] for n in lens], seqs, s), len(lens))
    assert_matches_golden(batch, g["logits"][lens], f"{name} decode_batch")
    for i, n in enumerate(lens):
        assert np.array_equal(run_prompt(m, ids[:n + 1], n)[-1], batch[i]), (name, i)


@pytest.mark.parametrize("name", QUANT_FIXTURES)
def test_tensor_api_matches_golden(name):
    g = golden(name)
    ids = g["input_ids"]
    gm = metrale.load_generative(FIXTURES / name, HostBackend(), progress=False)
    with gm.create_kv_cache(CacheConfig(max_seq_len=32)) as cache:
        rows = [to_numpy(gm.prefill(gm.embed(ids[:, :10]), cache, range(0, 10)))[0]]
        for t in range(10, 16):
            rows.append(to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0])
    assert_matches_golden(np.stack(rows), g["logits"][9:16], f"{name} tensor API")


def test_weight_bytes_are_the_uploaded_bytes():
    for name in QUANT_FIXTURES:
        be = HostBackend()
        m = load(FIXTURES / name, be)
        W = m._weights
        meta = m._meta
        from metrale.model_engine.memory_plan import weight_bytes
        linears = [x for L in W.layers for x in (L.qkv, L.o_proj, L.gate_up, L.down_proj)]
        linears.append(W.lm_head)
        q_bytes = sum(x.nbytes for x in linears if isinstance(x, (Q4Linear, Fp8Linear)))
        assert q_bytes > 0
        assert W.nbytes == weight_bytes(meta), name
        bf16 = weight_bytes(DequantizedSource(open_source(FIXTURES / name)).metadata())
        assert W.nbytes < bf16, name


# ------------------------------------------------- every honoured field matters
def _copy(tmp_path, name, edit_config=None):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _err(path_or_model, name):
    g = golden(name)
    m = path_or_model if not hasattr(path_or_model, "is_dir") else load(path_or_model)
    return rel_err(run_prompt(m, g["input_ids"][0].tolist()[:14], 14)[0], g["logits"][13])


def test_golden_differs_when_the_gptq_v1_minus_one_is_ignored(tmp_path):
    """checkpoint_format gptq stores z - 1: read as gptq_v2, every zero point is off by one."""
    name = "q_gptq_v1"
    assert _err(FIXTURES / name, name) < 0.03
    wrong = _copy(tmp_path, name, lambda q: q.update(checkpoint_format="gptq_v2"))
    assert _err(wrong, name) > 0.1


def test_golden_differs_without_act_order_or_the_awq_order(monkeypatch):
    from metrale.formats.quant import int4 as quant_int4
    name = "q_gptq_v2_actorder"
    monkeypatch.setattr(quant_int4.Int4Config, "_g_idx", lambda *a: None)   # g_idx ignored
    assert _err(FIXTURES / name, name) > 0.1
    monkeypatch.undo()
    monkeypatch.setattr(quant_int4, "AWQ_ORDER", tuple(range(8)))   # plain nibble order
    assert _err(FIXTURES / "q_awq", "q_awq") > 0.1


@pytest.mark.parametrize("name", QUANT_FIXTURES)
def test_golden_differs_when_scales_are_ignored(monkeypatch, name):
    from metrale.formats.quant import fp8 as quant_fp8, int4 as quant_int4
    real_q4, real_f8 = quant_int4.Int4Config.read, quant_fp8.Fp8Config.read

    def q4(self, *a):
        h = real_q4(self, *a)
        h.scales = np.full_like(h.scales, np.float16(1.0 / 64).view(np.uint16))
        return h

    def f8(self, *a):
        h = real_f8(self, *a)
        h.scales = np.full_like(h.scales, np.median(h.scales))
        return h
    monkeypatch.setattr(quant_int4.Int4Config, "read", q4)
    monkeypatch.setattr(quant_fp8.Fp8Config, "read", f8)
    assert _err(FIXTURES / name, name) > 0.1


def test_golden_differs_with_a_shifted_block_grid(monkeypatch):
    """FP8 block scales: each row's scales from the neighbouring row block."""
    from metrale.formats.quant import fp8 as quant_fp8
    real = quant_fp8.Fp8Config.read

    def shifted(self, *a):
        h = real(self, *a)
        h.scale_row = ((h.scale_row + 1) % len(h.scales)).astype(np.int32)
        return h
    monkeypatch.setattr(quant_fp8.Fp8Config, "read", shifted)
    assert _err(FIXTURES / "q_fp8_head", "q_fp8_head") > 0.1


def test_modules_left_unquantized_are_read_as_bf16(tmp_path):
    """q_fp8_block leaves k_proj and the head in BF16: ignoring modules_to_not_convert (HF's
    default skips only) asks for k_proj's FP8 tensors, which the checkpoint does not have."""
    m = load(FIXTURES / "q_fp8_block")
    assert not isinstance(m._weights.layers[0].qkv, (Fp8Linear, Q4Linear))   # split group
    assert isinstance(m._weights.layers[0].gate_up, Fp8Linear)
    wrong = _copy(tmp_path, "q_fp8_block", lambda q: q.pop("modules_to_not_convert"))
    with pytest.raises(metrale.FormatError, match=r"k_proj\.weight.*BF16|k_proj"):
        load(wrong)
    awq = load(FIXTURES / "q_awq")
    assert isinstance(awq._weights.layers[0].gate_up, Q4Linear)
    assert not isinstance(awq._weights.layers[0].down_proj, Q4Linear)
