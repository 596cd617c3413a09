"""Tiny GGUF models (tests/fixtures/gguf/: llama with Q4_K / Q5_K / Q8_0 / Q4_0 / Q4_1 /
Q5_0 / F16, qwen2 with Q6_K and biases, qwen3 with Q5_1 / Q5_K and q/k norms) against
transformers' fp32 logits of the same files, through the pointer API and the tensor API, on
HostBackend and (marked gpu) on the emulated kernels; loaded as by default, their block-type
weights kept at their stored bytes (test_gguf_packed.py: bit for bit the dequantize-at-load
model)."""
from __future__ import annotations

import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend, backend
from metrale.model_engine.linear import GgufLinear
from tests.conftest import emu_available
from tests.formats.gguf_util import GGUF_FIXTURES
from tests.model.common import assert_matches_golden, logits_rows

MODELS = ["llama", "qwen2", "qwen3"]


def golden(name):
    with np.load(GGUF_FIXTURES / f"{name}.npz") as g:
        return {k: g[k] for k in g.files}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device_name", ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])])
def test_pointer_api_prefill_and_decode(name, device_name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = metrale.load(GGUF_FIXTURES / f"{name}.gguf", backend(device_name), progress=False)
    W = m._weights
    assert any(isinstance(x, GgufLinear) for x in [W.embed_tokens, W.lm_head] + [
        L.qkv for L in W.layers] + [L.down_proj for L in W.layers]), "nothing stayed packed"
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:16], seq, s))[0]]
    for t in range(16, 24):
        rows.append(logits_rows(m, m.decode(ids[t], seq, s))[0])
    assert_matches_golden(np.stack(rows), g["logits"][15:24], f"{name} on {device_name}")
    m.teardown()


@pytest.mark.parametrize("name", MODELS)
def test_tensor_api_all_logits(name):
    g = golden(name)
    gm = metrale.load_generative(GGUF_FIXTURES / f"{name}.gguf", HostBackend(),
                                 progress=False)
    with gm.create_kv_cache(CacheConfig(max_seq_len=24)) as cache:
        rows = to_numpy(gm.prefill_all_logits(gm.embed(g["input_ids"]), cache, range(24)))
    assert_matches_golden(rows[0], g["logits"], f"{name} prefill_all_logits")
