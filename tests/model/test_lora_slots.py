"""The original's adapter contract on the slots (model_engine/adapters.py): adapter ids,
acquire / release, rotation, disk swap and promotion with their refusals, the sequence
binding, the load options and the memory they reserve."""
import numpy as np
import pytest

import metrale
from metrale.errors import AdapterPoolFull, InvalidArgument, OutOfMemory, Unsupported
from metrale.formats import open_source
from metrale.gpu_runtime import HostBackend
from metrale.model_engine.adapters import adapter_id_hash
from metrale.model_engine.lora_options import lora_options
from metrale.model_engine.lora_pool import pool_bytes
from tests.model.common import FIXTURES, golden
from tests.model.lora_util import LORA, adapter_dirs

BASE = FIXTURES / "qwen2"
IDS = golden("qwen2")["input_ids"][0].tolist()


def load(**kw):
    return metrale.load(BASE, HostBackend(), progress=False, **kw)


def test_adapter_ids_follow_the_original():
    m = load(max_loras=3, loras=adapter_dirs(["qv_r8"]))
    assert m.adapter_id_for(0) == adapter_id_hash("qv_r8", 0) != 0
    assert m.adapter_id_for(1) == 0 and m.adapter_id_for(7) == 0     # empty, out of range
    assert m.adapter_id_for(-1) == 0                                  # nothing active
    m.set_active_lora("qv_r8")
    assert m.adapter_id_for(-1) == m.adapter_id_for(0)
    m.swap_lora_from_disk(LORA / "qv_r8", "qv_r8", 0)                 # a reload: a new id
    assert m.adapter_id_for(0) == adapter_id_hash("qv_r8", 1) != adapter_id_hash("qv_r8", 0)
    # FNV-1a: the empty name's hash is the offset basis
    assert adapter_id_hash("", 0) == 0xcbf29ce484222325
    assert load().adapter_id_for(0) == 0 and load().acquire_adapter_slot(0) == -1


def test_acquire_release_and_the_sequence_binding():
    m = load(max_loras=2, loras=adapter_dirs(["qv_r8"]))
    s = m.default_stream()
    assert m.acquire_adapter_slot(-1) == -1          # nothing active: no ref taken
    assert m.acquire_adapter_slot(5) == -1
    assert m.acquire_adapter_slot(0) == 0 and m.lora_slots()[0].in_flight == 1
    m.release_adapter_slot(0)
    m.release_adapter_slot(0)                        # saturates at 0
    m.release_adapter_slot(-1)
    assert m.lora_slots()[0].in_flight == 0
    seq = m.alloc_sequence(adapter="qv_r8")
    assert (seq.adapter_slot, seq.acquired_adapter_slot, seq.adapter_id) == (0, -1, None)
    m.prefill(IDS[:5], seq, s)                       # the first pass binds it
    assert seq.acquired_adapter_slot == 0 and seq.adapter_id == m.adapter_id_for(0)
    kid = m.fork_sequence(seq)
    assert m.lora_slots()[0].in_flight == 2 and kid.adapter_id == seq.adapter_id
    with pytest.raises(InvalidArgument, match="in-flight"):
        m.swap_lora_from_disk(LORA / "pattern_r4", "p", 0)
    with pytest.raises(InvalidArgument, match="in-flight"):
        m.unload_lora("qv_r8")
    m.free_sequence(seq)
    m.free_sequence(seq)                             # idempotent: released once
    m.free_sequence(kid)
    assert m.lora_slots()[0].in_flight == 0
    # a caller that acquired itself (the original's scheduler) keeps its slot
    pre = m.alloc_sequence()
    pre.acquired_adapter_slot = m.acquire_adapter_slot(0)
    m.prefill(IDS[:5], pre, s)
    assert pre.adapter_id == m.adapter_id_for(0)
    m.free_sequence(pre)
    assert m.lora_slots()[0].in_flight == 0


def test_rotation_binds_new_sequences_only():
    m = load(loras=adapter_dirs(["qv_r8", "pattern_r4"]))
    s = m.default_stream()
    early = m.alloc_sequence()                       # -1: the active adapter, at binding
    m.prefill(IDS[:4], early, s)
    assert early.adapter_id == 0
    m.set_active_lora("pattern_r4")
    late = m.alloc_sequence()
    m.prefill(IDS[:4], late, s)
    assert late.acquired_adapter_slot == 1 and early.adapter_id == 0
    with pytest.raises(InvalidArgument, match="'nope' is not resident.*qv_r8, pattern_r4"):
        m.set_active_lora("nope")
    m.set_active_lora(None)
    assert m.adapter_id_for(-1) == 0


def test_promotion_picks_empty_then_lru_idle_and_never_pinned():
    m = load(max_loras=3, max_lora_rank=64, loras=adapter_dirs(["qv_r8"]))
    assert m.promote_lora_from_disk(LORA / "pattern_r4", "p") == (1, None)
    assert m.lora_slots()[1].active
    assert m.promote_lora_from_disk(LORA / "mlp_layer1_r64", "mlp") == (2, None)
    # slot 1 used least recently: evicted; slot 0 holds a start-up adapter, never
    assert m.promote_lora_from_disk(LORA / "all_r16_rslora", "all") == (1, "p")
    busy = [m.alloc_sequence(adapter=n) for n in ("all", "mlp")]
    for q in busy:
        m.prefill(IDS[:3], q, m.default_stream())
    with pytest.raises(AdapterPoolFull, match="2 cache slot"):
        m.promote_lora_from_disk(LORA / "pattern_r4", "p")
    assert [x.name for x in m.lora_slots()] == ["qv_r8", "all", "mlp"]   # nothing changed
    with pytest.raises(Unsupported, match="promote_lora_from_peer.*no communicator"):
        m.promote_lora_from_peer("10.0.0.1:5000", "id", "p", None)


def test_refusals_name_what_is_wrong(tmp_path):
    m = load(max_loras=2, max_lora_rank=8)
    with pytest.raises(Unsupported, match="rank 16.*max_lora_rank=8"):
        m.swap_lora_from_disk(LORA / "all_r16_rslora", "a", 0)
    with pytest.raises(InvalidArgument, match=r"slot 2 is outside \[0, max_loras=2\)"):
        m.swap_lora_from_disk(LORA / "qv_r8", "a", 2)
    m.swap_lora_from_disk(LORA / "qv_r8", "a", 0)
    with pytest.raises(InvalidArgument, match="already resident in slot 0"):
        m.swap_lora_from_disk(LORA / "qv_r8", "a", 1)
    with pytest.raises(InvalidArgument, match="slot 1 holds no adapter"):
        m.alloc_sequence(adapter=1)
    with pytest.raises(InvalidArgument, match="'b' is not resident"):
        m.alloc_sequence(adapter="b")
    assert [x.name for x in m.lora_slots()] == ["a", None]   # refusals changed nothing
    plain = load()
    for call in (lambda: plain.alloc_sequence(adapter="a"), lambda: plain.set_active_lora("a"),
                 lambda: plain.swap_lora_from_disk(LORA / "qv_r8", "a", 0)):
        with pytest.raises(Unsupported, match="max_loras"):
            call()


def test_load_options():
    src = open_source(BASE)
    meta = src.metadata()
    o = lora_options(src, meta, 0, None, adapter_dirs(["qv_r8", "mlp_layer1_r64"]))
    assert (o.n_slots, o.max_rank) == (2, 64)         # defaults from the adapters
    assert lora_options(src, meta, 0, None, None).n_slots == 0
    with pytest.raises(InvalidArgument, match="max_lora_rank=300"):
        lora_options(src, meta, 2, 300, None)
    with pytest.raises(InvalidArgument, match="2 adapters for max_loras=1"):
        lora_options(src, meta, 1, 64, adapter_dirs(["qv_r8", "pattern_r4"]))
    with pytest.raises(InvalidArgument, match="twice"):
        lora_options(src, meta, 2, 64, [("a", LORA / "qv_r8"), ("a", LORA / "pattern_r4")])
    with pytest.raises(Unsupported, match="max_lora_rank=4"):   # read before any allocation
        lora_options(src, meta, 1, 4, adapter_dirs(["qv_r8"]))


def test_the_memory_plan_counts_the_slots(monkeypatch):
    m = load(max_loras=3, max_lora_rank=32)
    meta = m.metadata()
    rows = max(m._ws.max_tokens, m._ws.max_rows)
    assert m._lora.nbytes == pool_bytes(meta, 3, 32, rows)
    per = m.lora_slots()[0].nbytes
    # q|k|v, o, gate|up and down of both layers at rank 32: A, B and FP32 scales
    h, i = meta.hidden_size, meta.intermediate_size
    qkv = meta.num_heads * meta.head_dim + 2 * meta.num_kv_heads * meta.head_dim
    assert per == 2 * (2 * 32 * (3 * h + h + 2 * h + i) + 2 * (qkv + h + 2 * i + h) * 32 +
                       4 * (3 + 1 + 2 + 1))
    # the plan counts the slots: a load that fits without them is refused with them, before
    # anything is allocated
    be = HostBackend()
    plain = metrale.load(BASE, be, progress=False, kv_blocks=4)
    held = be.live_bytes()
    plain.teardown()
    lora = pool_bytes(meta, 64, 256, rows)
    monkeypatch.setattr(be, "free_memory", lambda: held + lora // 2)
    with pytest.raises(OutOfMemory):
        metrale.load(BASE, be, progress=False, kv_blocks=4, max_loras=64, max_lora_rank=256)
    assert be.live_bytes() == 0
    monkeypatch.setattr(be, "free_memory", lambda: held + lora + (1 << 20))
    metrale.load(BASE, be, progress=False, kv_blocks=4, max_loras=64,
                 max_lora_rank=256).teardown()


def test_lora_slots_reports():
    m = load(max_loras=2, loras=adapter_dirs(["pattern_r4"]))
    info = m.lora_slots()
    assert info[0].name == "pattern_r4" and info[0].rank == 12 and info[0].pinned
    assert info[0].modules == ("k_proj", "o_proj", "up_proj", "down_proj")
    assert info[1].name is None and not info[1].pinned
    assert np.all([x.nbytes == info[0].nbytes for x in info])


def test_other_architectures_refuse_slots_by_name():
    be = HostBackend()
    with pytest.raises(Unsupported, match="llava"):
        metrale.load(FIXTURES / "llava_tiny", be, progress=False, max_loras=2)
    with pytest.raises(InvalidArgument, match="max_loras"):
        metrale.load(FIXTURES / "whisper_tiny", be, progress=False, max_loras=2)
    assert be.live_bytes() == 0
