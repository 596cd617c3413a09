"""Mixture-of-experts decoders beyond the shared golden tests (test_golden.py and
test_field_fixtures.py run these fixtures through every forward path on cpu and emu):
which expert holds which weights matters, each MoE-specific piece is exercised, rows are
bit-identical across batch sizes, batch mixes and grouped-GEMM tiles, speculative decoding
equals greedy, and bad checkpoints are refused by name before anything is uploaded."""
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

import metrale
from metrale.engine import generate, speculative_generate
from metrale.errors import FormatError
from metrale.formats import check_tensors, expected_tensors, open_source
from metrale.formats.metadata import ModelMetadata
from metrale.gpu_runtime import HostBackend, backend
from metrale.gpu_runtime.types import NULL
from metrale.ops import moe_gemm
from tests.conftest import emu_available
from tests.formats.st_util import tensors_bytes
from tests.model.common import (FIXTURES, MOE_FIXTURES, MOE_STRUCTURAL, assert_matches_golden,
                                golden, load, logits_rows, rel_err)

BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def last_logits(m, ids):
    return logits_rows(m, m.prefill(ids, m.alloc_sequence(), m.default_stream()))[0]


def teacher_forced(m, ids, prefix=6):
    """Logits after positions prefix - 1 .. len(ids) - 1: a prefill, then decode steps."""
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:prefix], seq, s))[0]]
    rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in ids[prefix:]]
    m.free_sequence(seq)
    return np.stack(rows)


def read_bits(m, ptr, n):
    out = np.empty(n, np.uint16)
    m.backend.copy_d2h(ptr, out)
    return out


def write_bits(m, ptr, arr):
    m.backend.copy_h2d(np.ascontiguousarray(arr, np.uint16), ptr)


def permute_experts(m, perm, router_too: bool) -> None:
    """Reorder every sparse layer's experts on the device (expert e takes perm[e]'s
    weights); with `router_too` the router rows move with them: the same model."""
    meta, moe = m._meta, m._meta.moe
    E, h, i = moe.num_experts, meta.hidden_size, moe.expert_intermediate_size
    for L in m._weights.layers:
        if L.moe is None:
            continue
        for ptr, per in ((L.moe.gate_up, 2 * i * h), (L.moe.down, h * i)) + \
                (((L.moe.router, h),) if router_too else ()):
            w = read_bits(m, ptr, E * per).reshape(E, per)
            write_bits(m, ptr, w[perm])


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_which_expert_holds_which_weights_matters(name):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    E = load(name)._meta.moe.num_experts
    perm = np.roll(np.arange(E), 1)
    m = load(name)
    want = last_logits(m, ids)
    permute_experts(m, perm, router_too=False)
    assert rel_err(last_logits(m, ids), g["logits"][-1]) > 0.03, f"{name}: permuted experts"
    permute_experts(m, np.argsort(perm), router_too=False)   # back
    permute_experts(m, perm, router_too=True)                # the same model, renumbered
    assert np.array_equal(last_logits(m, ids), want)


def _shared_gate_ignored(m):
    for L in m._weights.layers:
        if L.moe is not None:
            L.moe.shared_gate = NULL        # the combine then weighs the shared expert by 1


def _shared_expert_dropped(m):
    m._meta = replace(m._meta, moe=replace(m._meta.moe, shared_expert_intermediate_size=0))


def _top_1(m):
    m._meta = replace(m._meta, moe=replace(m._meta.moe, top_k=1))


def _no_renormalisation(m):
    m._meta = replace(m._meta, moe=replace(m._meta.moe, norm_topk_prob=False))


@pytest.mark.parametrize("name,ignore", [
    ("qwen2_moe", _shared_gate_ignored), ("qwen2_moe", _shared_expert_dropped),
    ("qwen3_moe", _top_1), ("mixtral", _top_1), ("mixtral", _no_renormalisation)])
def test_each_moe_piece_is_exercised(name, ignore):
    """A model missing the piece (the shared expert's sigmoid gate, the shared expert,
    the second expert, mixtral's renormalisation) fails the golden."""
    g = golden(name)
    m = load(name, graphs=False)   # eager: a captured decode graph would keep the old model
    assert_matches_golden(teacher_forced(m, g["input_ids"][0].tolist()), g["logits"][5:], name)
    ignore(m)
    m._layer_meta = m._meta   # what the passes read (one device: the same metadata)
    assert rel_err(teacher_forced(m, g["input_ids"][0].tolist()), g["logits"][5:]) > 0.03


@pytest.mark.parametrize("name", MOE_STRUCTURAL)
def test_structural_fields_change_the_layout(name):
    """decoder_sparse_step, mlp_only_layers and qkv_bias decide which tensors a layer has:
    a parser that ignored one would expect other tensors and refuse the checkpoint."""
    src = open_source(FIXTURES / name)
    cfg = src.config()
    field = {"qwen3_moe_decoder_sparse_step": "decoder_sparse_step",
             "qwen2_moe_mlp_only_layers": "mlp_only_layers",
             "qwen2_moe_no_qkv_bias": "qkv_bias"}[name]
    del cfg[field]
    ignored = ModelMetadata.from_config(cfg)
    with pytest.raises(FormatError, match="missing tensor|no part of the model uses"):
        check_tensors(src, expected_tensors(ignored, src.tensor_names()))


# ---------------------------------------------------------------------- batch invariance
def _decode_rows(m, ids, lens):
    """decode_batch of rows (prefix ids[:L], next token ids[L]) for L in lens: bits."""
    s = m.default_stream()
    seqs = []
    for L in lens:
        seq = m.alloc_sequence()
        m.prefill(ids[:L], seq, s)
        seqs.append(seq)
    ptr = m.decode_batch([ids[L] for L in lens], seqs, s)
    bits = np.empty((len(lens), m.vocab_size()), np.uint16)
    m.copy_logits_to_host(ptr, bits.view(np.uint8).reshape(-1))
    for seq in seqs:
        m.free_sequence(seq)
    return bits


@pytest.mark.parametrize("device_name", BACKENDS)
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_rows_are_bit_identical_across_batch_sizes_and_mixes(name, device_name):
    ids = golden(name)["input_ids"][0].tolist()
    m = load(name, backend(device_name), max_batch=8)
    solo = {L: _decode_rows(m, ids, [L])[0] for L in (2, 5, 9, 14, 20)}
    for lens in ([5, 9], [20, 2, 14], [9, 9, 9, 5], [14, 20, 5, 2, 9, 3, 11, 17]):
        rows = _decode_rows(m, ids, lens)
        for r, L in enumerate(lens):
            if L in solo:
                assert np.array_equal(rows[r], solo[L]), f"{name}: row {L} in batch {lens}"


@pytest.mark.parametrize("device_name", BACKENDS)
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_every_grouped_gemm_tile_gives_the_same_model(name, device_name, monkeypatch):
    """The tile is picked for speed (by rows per expert); forcing each one changes no bit
    of a prefill's logits or of the decode steps after it."""
    ids = golden(name)["input_ids"][0].tolist()
    m = load(name, backend(device_name))

    def run():
        s = m.default_stream()
        seq = m.alloc_sequence()
        out = [logits_rows(m, m.prefill(ids[:16], seq, s))]
        out += [logits_rows(m, m.decode(t, seq, s)) for t in ids[16:19]]
        m.free_sequence(seq)
        return np.concatenate(out)
    want = run()
    for tile in moe_gemm.TILES.values():
        monkeypatch.setattr(moe_gemm, "pick_tile", lambda n_pairs, E, t=tile: t)
        assert np.array_equal(run(), want), f"{name}: tile {tile.name}"


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_speculative_equals_greedy(name):
    target = load(name)
    prompt = golden(name)["input_ids"][0, :7].tolist()
    want = generate(target, prompt, 16, stop_token_ids=[]).tokens
    for draft_name in ("qwen3", [n for n in MOE_FIXTURES if n != name][0]):
        draft = load(draft_name)   # another random model over the same 256-token vocabulary
        for k in (1, 3, 5):
            r = speculative_generate(target, draft, prompt, 16, k=k, stop_token_ids=[])
            assert r.tokens == want, (name, draft_name, k)
    r = speculative_generate(target, load(name), prompt, 16, k=4, stop_token_ids=[])
    assert r.tokens == want and r.accepted == r.proposed > 0


def test_tensor_api_all_logits_match_hf():
    g = golden("qwen2_moe")
    gm = metrale.load_generative(FIXTURES / "qwen2_moe", HostBackend(), progress=False)
    with gm.create_kv_cache(metrale.CacheConfig(max_seq_len=32)) as cache:
        rows = metrale.to_numpy(gm.prefill_all_logits(gm.embed(g["input_ids"]), cache,
                                                      range(0, 24)))[0]
    assert_matches_golden(rows, g["logits"], "qwen2_moe prefill_all_logits")


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_device_tensor_api_matches_hf_and_the_pointer_api(device, name):
    """The tensor contract on the real kernels (emu: the .cu sources): prefill + decode
    rows match the goldens and are the pointer API's bits; all-position logits too."""
    g = golden(name)
    ids = g["input_ids"]
    gm = metrale.load_generative(FIXTURES / name, device, progress=False)
    with gm.create_kv_cache(metrale.CacheConfig(max_seq_len=32)) as cache:
        rows = [metrale.to_numpy(gm.prefill(gm.embed(ids[:, :10]), cache, range(0, 10)))[0]]
        rows += [metrale.to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0]
                 for t in range(10, 24)]
    assert_matches_golden(np.stack(rows[:-1]), g["logits"][9:23], f"{name} tensor api")
    m = gm.model
    assert np.array_equal(np.stack(rows), teacher_forced(m, ids[0].tolist(), prefix=10))
    with gm.create_kv_cache(metrale.CacheConfig(max_seq_len=32)) as cache:
        all_rows = metrale.to_numpy(gm.prefill_all_logits(gm.embed(ids), cache,
                                                          range(0, 24)))[0]
    assert_matches_golden(all_rows, g["logits"], f"{name} prefill_all_logits")


# ------------------------------------------------------------------------- bad input
def _copy(tmp_path, name):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(d, fn):
    """fn(name -> BF16 bits) edits the checkpoint's tensors, written back as BF16."""
    src = open_source(d)
    t = {n: src.read_bf16(n) for n in src.tensor_names()}
    fn(t)
    del src
    (d / "model.safetensors").write_bytes(tensors_bytes({n: ("BF16", a) for n, a in t.items()}))


@pytest.mark.parametrize("case,match", [
    ("top_k", "num_experts_per_tok=5 exceeds the expert count 4"),
    ("mlp_only_layers", "mlp_only_layers holds 2, outside the 2 layers"),
    ("sparse_step", "decoder_sparse_step must be a positive integer"),
    ("experts_alias", "num_experts=4 and num_local_experts=5 disagree"),
    ("missing", "missing tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'"),
    ("shape", "model.layers.0.block_sparse_moe.experts.1.w1.weight' has shape \\[8, 64\\]"),
    ("fused", "no part of the model uses: model.layers.0.block_sparse_moe.experts.gate_up_proj"),
    # a quantization_config over BF16 experts (quantized experts are read: test_moe_quant.py)
    ("quantized", "model.layers.0.block_sparse_moe.experts.0.w1.weight' has dtype BF16; "
                  "expected F8_E4M3"),
])
def test_bad_checkpoints_are_refused_by_name_before_any_upload(tmp_path, case, match):
    err = FormatError
    name = "qwen3_moe" if case in ("mlp_only_layers", "sparse_step") else "mixtral"
    d = _copy(tmp_path, name)
    if case == "top_k":
        _edit_config(d, num_experts_per_tok=5)
    elif case == "mlp_only_layers":
        _edit_config(d, mlp_only_layers=[0, 2])
    elif case == "sparse_step":
        _edit_config(d, decoder_sparse_step=0)
    elif case == "quantized":
        _edit_config(d, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                             "weight_block_size": [128, 128],
                                             "modules_to_not_convert": ["lm_head", "q_proj", "k_proj",
                                                                        "v_proj", "o_proj"]})
    elif case == "experts_alias":
        _edit_config(d, num_experts=4, num_local_experts=5)
    elif case == "missing":
        _rewrite_tensors(d, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    elif case == "shape":
        key = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        _rewrite_tensors(d, lambda t: t.__setitem__(key, t[key][:8]))
    else:   # transformers' in-memory fused layout is not a checkpoint layout
        _rewrite_tensors(d, lambda t: t.__setitem__(
            "model.layers.0.block_sparse_moe.experts.gate_up_proj", np.zeros((4, 2), np.uint16)))
    be = HostBackend()
    with pytest.raises(err, match=match):
        metrale.load(d, be, progress=False)
    assert be.live_bytes() == 0


@pytest.mark.gpu
def test_device_graphs_equal_eager(device):
    """The MoE pass reads nothing back to the host: replayed CUDA graphs (emu: recorded
    launches) give the eager bits."""
    ids = golden("qwen2_moe")["input_ids"][0].tolist()
    eager = teacher_forced(load("qwen2_moe", device, graphs=False), ids)
    graphed = teacher_forced(load("qwen2_moe", device, graphs=True), ids)
    assert np.array_equal(eager, graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
@pytest.mark.parametrize("device_name", ["emu"])
def test_emu_runs_the_moe_kernels_compiled(device_name):
    from metrale.gpu_runtime.emu import EmuBackend
    emu = EmuBackend()
    teacher_forced(load("qwen2_moe", emu), golden("qwen2_moe")["input_ids"][0].tolist())
    stats = emu.launch_stats()
    assert not {k for k, v in stats.items() if v["twin"]}
    compiled = {k for k, v in stats.items() if v["compiled"]}
    assert {"moe_router.moe_topk_softmax", "moe_router.moe_route",
            "moe_gemm.moe_gemm_bf16_16x16", "moe_gemm.moe_gemm_fp32_16x16",
            "moe_combine.moe_combine", "gemm_tc.gemm_tc_fp32_16x16"} <= compiled
