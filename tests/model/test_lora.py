"""LoRA adapters through the whole decoder (issue 43): each adapter against HF + PEFT fp32
goldens on HostBackend and on the emulator; a batch mixing the base model and adapters bit
for bit each sequence alone (decode, batched prefill, verify, chunks); unloading restores the
base bits; decode graphs serve swapped slots without a recapture; quantized bases."""
import numpy as np
import pytest

import metrale
from metrale.formats import open_source
from metrale.formats.quant.checkpoint import DequantizedSource
from metrale.gpu_runtime import HostBackend, backend
from metrale.model_engine import PrefillSlice
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, logits_rows
from tests.model.lora_util import (ADAPTERS, adapter_dirs, bits, lora_golden, run_prompt,
                                   write_adapter)

EMU = pytest.param("emu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not emu_available(), reason="no C++ compiler")])
BASE = FIXTURES / "qwen2"


def load(be, **kw):
    return metrale.load(BASE, be, progress=False, **kw)


@pytest.fixture(params=["cpu", EMU])
def device_name(request):
    return request.param


@pytest.fixture
def model(device_name):
    return load(backend(device_name), loras=adapter_dirs())


def test_each_adapter_matches_hf_peft(model, device_name):
    base = golden("qwen2")
    ids = base["input_ids"][0].tolist()
    assert_matches_golden(run_prompt(model, ids, 12), base["logits"][11:], "base rows")
    for name in ADAPTERS:
        got = run_prompt(model, ids, 12, adapter=name)
        want = lora_golden(name)["logits"][11:]
        assert_matches_golden(got, want, f"{name} on {device_name}")
        # and the adapter matters: the base model's logits are far from these
        assert np.abs(got - base["logits"][11:]).max() > 0.2 * np.abs(want).max(), name


def test_mixed_batch_is_bit_equal_to_each_sequence_alone(model):
    ids = golden("qwen2")["input_ids"][0].tolist()
    s = model.default_stream()
    who = [None, "qv_r8", "all_r16_rslora", "qv_r8", None, "pattern_r4"]
    lens = [5, 9, 3, 12, 7, 10]
    seqs = [model.alloc_sequence(adapter=a) for a in who]
    # one batched prefill over all of them (8-row tiles per sequence) ...
    ptrs = model.prefill_batch_chunk([PrefillSlice(ids[:L], q, 0, L, True)
                                      for q, L in zip(seqs, lens)], s)
    first = [bits(model, p) for p in ptrs]
    # ... then one decode_batch (a tile per row)
    batch = bits(model, model.decode_batch([ids[L] for L in lens], seqs, s), len(seqs))
    for i, (a, L) in enumerate(zip(who, lens)):
        solo = model.alloc_sequence(adapter=a)
        assert np.array_equal(bits(model, model.prefill(ids[:L], solo, s)), first[i]), \
            f"row {i} ({a}): batched prefill != alone"
        assert np.array_equal(bits(model, model.decode(ids[L], solo, s))[0], batch[i]), \
            f"row {i} ({a}): decode_batch != alone"
        model.free_sequence(solo)


def test_verify_rows_and_chunks_equal_decode_steps(model):
    ids = golden("qwen2")["input_ids"][0].tolist()
    s = model.default_stream()
    whole = model.alloc_sequence(adapter="pattern_r4")
    want = [bits(model, model.prefill(ids[:20], whole, s))]
    want += [bits(model, model.decode(t, whole, s)) for t in ids[20:23]]
    seq = model.alloc_sequence(adapter="pattern_r4")
    for a, b in ((0, 5), (5, 12), (12, 20)):
        p = model.prefill_chunk(ids[:20], seq, a, b - a, b == 20, s)
    assert np.array_equal(bits(model, p), want[0]), "chunked prefill != whole prefill"
    model.decode_verify(ids[20:23], seq, s)
    rows = bits(model, model.logits_buffer_ptr(), 3)
    for i in range(2):
        assert np.array_equal(rows[i], want[i + 1][0]), f"verify row {i} != decode step"


def test_unloading_restores_the_base_bits(device_name):
    be = backend(device_name)
    ids = golden("qwen2")["input_ids"][0].tolist()
    plain = run_prompt(load(be), ids[:16], 10)
    m = load(be, max_loras=2, max_lora_rank=16)
    assert np.array_equal(run_prompt(m, ids[:16], 10), plain), "an empty pool changes nothing"
    m.swap_lora_from_disk(FIXTURES / "lora" / "all_r16_rslora", "a", 1)
    m.set_active_lora("a")
    adapted = run_prompt(m, ids[:16], 10)          # adapter=None: the active adapter
    assert not np.array_equal(adapted, plain)
    assert m.unload_lora("a") == 1
    assert np.array_equal(run_prompt(m, ids[:16], 10), plain), "unload left a delta behind"


def test_graphs_serve_swapped_slots_without_a_recapture(device_name):
    be = backend(device_name)
    ids = golden("qwen2")["input_ids"][0].tolist()
    m = load(be, max_loras=2, max_lora_rank=64, graphs=True)
    m.swap_lora_from_disk(FIXTURES / "lora" / "qv_r8", "x", 0)
    s = m.default_stream()

    def step(adapter):
        """A 2-row decode: `adapter`'s sequence beside a base one; its row's bits."""
        a, b = m.alloc_sequence(adapter=adapter), m.alloc_sequence()
        m.prefill(ids[:6], a, s)
        m.prefill(ids[:7], b, s)
        out = bits(m, m.decode_batch([ids[6], ids[7]], [a, b], s), 2)[0]
        m.free_sequence(a)
        m.free_sequence(b)
        return out
    step("x")
    graphs = dict(m._graphs)
    assert any(isinstance(k, tuple) for k in graphs), "no LoRA decode graph was captured"
    m.swap_lora_from_disk(FIXTURES / "lora" / "mlp_layer1_r64", "y", 0)
    got = step("y")
    assert m._graphs == graphs, "the swap recaptured a decode graph"
    eager = load(be, loras={"y": FIXTURES / "lora" / "mlp_layer1_r64"}, graphs=False)
    solo = eager.alloc_sequence(adapter="y")
    eager.prefill(ids[:6], solo, s)
    assert np.array_equal(got, bits(eager, eager.decode(ids[6], solo, s))[0])


def test_prefix_cache_is_shared_only_within_one_adapter():
    m = load(HostBackend(), loras=adapter_dirs(["qv_r8", "all_r16_rslora"]), block_size=4)
    ids = golden("qwen2")["input_ids"][0].tolist()[:13]
    s = m.default_stream()

    def run(adapter):
        seq = m.alloc_sequence(adapter=adapter)
        reused = m.reuse_prefix(seq, ids)
        out = bits(m, m.prefill_chunk(ids, seq, 0, len(ids), True, s))
        m.free_sequence(seq)     # prefill_chunk cached the prompt's full blocks
        return reused, out
    first = run("qv_r8")
    assert first[0] == 0
    assert run("all_r16_rslora")[0] == 0, "another adapter reused qv_r8's K/V"
    assert run(None)[0] == 0, "the base model reused an adapter's K/V"
    again = run("qv_r8")
    assert again[0] == 12 and np.array_equal(again[1], first[1])
    # a new load into the slot is a new adapter id: its old prefixes are not reused
    m.swap_lora_from_disk(FIXTURES / "lora" / "qv_r8", "qv_r8", 0)
    assert run("qv_r8")[0] == 0


@pytest.mark.parametrize("device_name", ["cpu", EMU])
@pytest.mark.parametrize("name", ["q_awq", "q_fp8_block"])
def test_quantized_base_with_bf16_adapter(tmp_path, name, device_name):
    """The adapter stays BF16 over a quantized base: the bits of the same adapter over the
    dequantized BF16 model."""
    be = backend(device_name)
    meta = open_source(FIXTURES / name).metadata()
    ad = write_adapter(tmp_path / "ad", meta)
    ids = golden(name)["input_ids"][0].tolist()[:14]
    q = metrale.load(FIXTURES / name, be, progress=False, loras={"ad": ad})
    ref = metrale.load(DequantizedSource(open_source(FIXTURES / name)), be, progress=False,
                       loras={"ad": ad})
    got = run_prompt(q, ids, 8, adapter="ad")
    assert np.array_equal(got, run_prompt(ref, ids, 8, adapter="ad"))
    assert not np.array_equal(got, run_prompt(q, ids, 8))


@pytest.mark.parametrize("device_name", ["cpu", EMU])
def test_gguf_base_kept_packed_with_bf16_adapter(tmp_path, device_name):
    """A GGUF kept at its block types plus an adapter: the bits of the same adapter over the
    file dequantized to BF16 at load."""
    be = backend(device_name)
    path = FIXTURES / "gguf" / "qwen2.gguf"
    ad = write_adapter(tmp_path / "ad", open_source(path).metadata(),
                       targets=("k_proj", "o_proj", "gate_proj", "up_proj"))
    packed = metrale.load(path, be, progress=False, loras={"ad": ad})
    ref = metrale.load(path, be, progress=False, loras={"ad": ad}, gguf_dequantize=True)
    assert packed.weight_bytes() < ref.weight_bytes()
    ids = list(range(5, 19))
    got = run_prompt(packed, ids, 8, adapter="ad")
    assert np.array_equal(got, run_prompt(ref, ids, 8, adapter="ad"))
    assert not np.array_equal(got, run_prompt(packed, ids, 8))


def test_tensor_api_runs_the_active_adapter():
    """The tensor contract's caches take the model's sequences: they run the active adapter
    (set_active_lora), the pointer API's rows bit for bit."""
    gm = metrale.load_generative(BASE, HostBackend(), progress=False,
                                 loras=adapter_dirs(["pattern_r4"]))
    ids = golden("qwen2")["input_ids"][0].tolist()[:10]
    gm.model.set_active_lora("pattern_r4")
    cache = gm.create_kv_cache()
    got = metrale.to_numpy(gm.prefill(gm.embed(np.asarray([ids], np.int32)), cache,
                                      range(0, len(ids))))
    m = gm.model
    seq = m.alloc_sequence(adapter="pattern_r4")
    want = logits_rows(m, m.prefill(ids, seq, m.default_stream()))
    assert np.array_equal(got, want)
