"""Every honoured config field (formats/field_table.py) against golden Hugging Face fp32
logits of a tiny checkpoint that exercises it: the prefill's last row and every
teacher-forced decode row, through the pointer API and the tensor API (paged and
contiguous caches) on HostBackend, and the pointer API on the EmuBackend (the kernels)."""
import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend, backend
from tests.conftest import emu_available
from tests.model.common import (FIELD_FIXTURES, FIXTURES, MOE_STRUCTURAL, assert_matches_golden,
                                golden, load, logits_rows, rel_err)

BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]
PREFIX = 6   # prompt prefilled before the teacher-forced decode steps (> the window of 5)


@pytest.mark.parametrize("device_name", BACKENDS)
@pytest.mark.parametrize("name", FIELD_FIXTURES)
def test_pointer_api_matches_hf(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(name, backend(device_name))
    s = m.default_stream()
    seq = m.alloc_sequence()
    last = logits_rows(m, m.prefill(ids, seq, s))
    assert_matches_golden(last, g["logits"][-1], f"{name} prefill last row")
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:PREFIX], seq, s))[0]]
    for t in range(PREFIX, len(ids)):
        rows.append(logits_rows(m, m.decode(ids[t], seq, s))[0])
    assert_matches_golden(np.stack(rows), g["logits"][PREFIX - 1:], f"{name} decode rows")
    m.teardown()


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("name", FIELD_FIXTURES)
def test_tensor_api_matches_hf(name, kind):
    _tensor_api(name, kind, HostBackend())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("name", [n for n in FIELD_FIXTURES if "window" in n])
def test_tensor_api_windows_on_device(device, name, kind):
    """Per-layer windows through the kernels (emu or CUDA), over the paged pool and the
    dense cache."""
    _tensor_api(name, kind, device)


def _tensor_api(name, kind, be):
    g = golden(name)
    ids = g["input_ids"]
    gm = metrale.load_generative(FIXTURES / name, be, progress=False)
    with gm.create_kv_cache(CacheConfig(kind=kind, max_seq_len=32)) as cache:
        rows = [to_numpy(gm.prefill(gm.embed(ids[:, :PREFIX]), cache, range(0, PREFIX)))[0]]
        for t in range(PREFIX, ids.shape[1]):
            rows.append(to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0])
    # row i is the logits after position PREFIX - 1 + i
    assert_matches_golden(np.stack(rows[:-1]), g["logits"][PREFIX - 1:-1], f"{name} {kind}")
    with gm.create_kv_cache(CacheConfig(kind=kind, max_seq_len=32)) as cache:
        last = to_numpy(gm.prefill(gm.embed(ids), cache, range(0, ids.shape[1])))
    assert_matches_golden(last, g["logits"][-1], f"{name} {kind} prefill")


def _neutralise(name, m):
    """The model as it was before the field was honoured (the bug each fixture catches)."""
    from dataclasses import replace

    from metrale.gpu_runtime.types import NULL
    if "attention_bias" in name:
        for L in m._weights.layers:
            L.o_bias = NULL
    elif "mlp_bias" in name:
        for L in m._weights.layers:
            L.gate_up_bias = L.down_bias = NULL
    elif "window" in name:   # the layer passes read _layer_meta (a rank's own counts)
        m._meta = m._layer_meta = replace(m._meta, layer_windows=(0,) * m._meta.num_layers)
    elif "stored_head" in name:
        m._weights.lm_head = m._weights.embed_tokens
    elif "norm_topk_prob" in name:
        m._meta = m._layer_meta = replace(m._meta, moe=replace(m._meta.moe, norm_topk_prob=False))
    else:   # an activation
        m._meta = m._layer_meta = replace(m._meta, hidden_act="silu")


# dynamic rope below its limit IS the default rope (in HF too): nothing to ignore there;
# its limit is tested in tests/formats/test_refusals.py
@pytest.mark.parametrize("name", [n for n in FIELD_FIXTURES
                                  if n != "llama_dynamic_rope" and n not in MOE_STRUCTURAL])
def test_each_fixture_catches_a_model_that_ignores_its_field(name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(name)
    _neutralise(name, m)
    got = logits_rows(m, m.prefill(ids, m.alloc_sequence(), m.default_stream()))
    assert rel_err(got[0], g["logits"][-1]) > 0.03, f"{name}: fixture does not exercise it"
