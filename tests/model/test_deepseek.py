"""DeepSeek-V3 / V2 (MLA + DeepSeek MoE) against golden transformers fp32 logits of tiny random
checkpoints (tests/fixtures/make_deepseek_fixtures.py), through every forward path of the
shared golden suite (its tests re-run here on these fixtures), plus: each DeepSeek feature
neutralised moves the logits past the golden tolerance (the fixtures test what they claim),
the KV pool holds the latent only, and what is refused."""
from dataclasses import replace

import numpy as np
import pytest

import metrale
from metrale.errors import Unsupported
from metrale.gpu_runtime import HostBackend, backend
from metrale.gpu_runtime.types import NULL
from tests.conftest import emu_available
from tests.model.common import FIXTURES, assert_matches_golden, golden, load, logits_rows, rel_err
from tests.model.test_golden import (  # noqa: F401 (re-run on the DeepSeek fixtures)
    test_batched_prefill_defaults_place_rows, test_chunked_prefill_equals_whole_prefill_bits,
    test_decode_batch_mixed_lengths_is_batch_invariant, test_decode_verify_rows_equal_decode_steps,
    test_fp32_logits_and_graphs, test_prefill_chunks_then_teacher_forced_decode,
    test_prefill_last_logits)

DEEPSEEK_FIXTURES = ["deepseek_v3", "deepseek_v2"]
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


@pytest.fixture(params=BACKENDS)
def device_name(request):
    return request.param


@pytest.fixture(params=DEEPSEEK_FIXTURES)
def case(request, device_name):
    name = request.param
    return name, load(name, backend(device_name)), golden(name)


def teacher_forced(m, ids, prefix=6):
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:prefix], seq, s))[0]]
    rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in ids[prefix:]]
    m.free_sequence(seq)
    return np.stack(rows)


def _neutralise(m, feature):
    meta = m._meta
    moe = meta.moe
    if feature == "correction bias":
        for L in m._weights.layers:
            if L.moe is not None:
                L.moe.correction_bias = NULL
    elif feature == "group limit":
        meta = replace(meta, moe=replace(moe, deepseek=replace(moe.deepseek, n_group=1,
                                                                   topk_group=1)))
    elif feature == "routed_scaling_factor":
        meta = replace(meta, moe=replace(moe, deepseek=replace(
            moe.deepseek, routed_scaling_factor=1.0)))
    elif feature == "norm_topk_prob":
        meta = replace(meta, moe=replace(moe, norm_topk_prob=False))
    elif feature == "shared experts":
        for L in m._weights.layers:
            if L.moe is not None:
                L.moe.shared_gate_up = L.moe.shared_down = NULL
        meta = replace(meta, moe=replace(moe, shared_expert_intermediate_size=0))
    elif feature == "mscale_all_dim":   # the plain qk_head_dim ** -0.5
        meta = replace(meta, mla=replace(meta.mla, softmax_scale=meta.mla.qk_head_dim ** -0.5))
    elif feature == "rope pairs":
        meta = replace(meta, mla=replace(meta.mla, rope_pairs_adjacent=False))
    m._meta = m._layer_meta = meta


@pytest.mark.parametrize("name, feature", [
    ("deepseek_v3", "correction bias"), ("deepseek_v3", "group limit"),
    ("deepseek_v3", "routed_scaling_factor"), ("deepseek_v3", "norm_topk_prob"),
    ("deepseek_v3", "shared experts"), ("deepseek_v3", "mscale_all_dim"),
    ("deepseek_v3", "rope pairs"), ("deepseek_v2", "group limit"),
    ("deepseek_v2", "routed_scaling_factor"), ("deepseek_v2", "shared experts"),
    ("deepseek_v2", "mscale_all_dim")])
def test_each_feature_moves_the_logits(name, feature):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(name, fp32_logits=True)
    assert_matches_golden(teacher_forced(m, ids), g["logits"][5:], name)
    _neutralise(m, feature)
    err = rel_err(teacher_forced(m, ids), g["logits"][5:])
    assert err > 0.03, f"{name}: without {feature} the logits move only {err:.4f}"


@pytest.mark.parametrize("name", DEEPSEEK_FIXTURES)
def test_kv_pool_holds_the_latent_only(name):
    m = load(name, kv_blocks=10, block_size=16)
    a = m._meta.mla
    per_token_layer = (a.kv_lora_rank + a.qk_rope_head_dim) * 2
    assert m._ws.block_bytes == 16 * per_token_layer
    assert m._ws.kv_bytes == m._meta.num_layers * 11 * 16 * per_token_layer   # + pad block
    m.teardown()


def test_info_reports_the_latent_kv_bytes(capsys):
    from metrale.cli import main
    assert main(["info", str(FIXTURES / "deepseek_v3"), "--json"]) == 0
    import json
    info = json.loads(capsys.readouterr().out)
    assert info["kv_bytes_per_token"] == 3 * (32 + 8) * 2   # layers * latent * bf16
    assert info["architecture"] == "deepseek_v3"
    # the decoder estimates (workspaces, a decode step's bytes) are made for it too
    from metrale.bench.roofline import kv_bytes_per_token
    from metrale.formats import open_source
    assert kv_bytes_per_token(open_source(FIXTURES / "deepseek_v3").metadata()) == 240
    assert info["decode_step_bytes"] and info["memory_needed_bytes"] > info["weight_bytes"]


def test_lora_and_contiguous_cache_refused():
    with pytest.raises(Unsupported, match="LoRA adapters and tensor parallelism"):
        load("deepseek_v3", max_loras=1)
    m = load("deepseek_v3")
    with pytest.raises(Unsupported, match="latent KV cache"):
        from metrale.kv.contiguous import ContiguousArena   # noqa: F401
        from metrale.model_engine.deepseek import run_deepseek_decoder
        run_deepseek_decoder(m, 0, 1, n_seqs=1, out_ptr=m._ws.normed, arena=object())


def test_kimi_k2_checkpoint_is_deepseek_v3(tmp_path):
    """The V3 fixture with Kimi K2's model_type gives the V3 logits bit for bit."""
    import json
    import shutil
    d = tmp_path / "kimi_k2"
    shutil.copytree(FIXTURES / "deepseek_v3", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="kimi_k2")))
    ids = golden("deepseek_v3")["input_ids"][0].tolist()[:12]
    ref = load("deepseek_v3")
    kimi = metrale.load(d, HostBackend(), progress=False)
    assert kimi.metadata().architecture == "deepseek_v3"
    assert np.array_equal(teacher_forced(kimi, ids), teacher_forced(ref, ids))


def test_mtp_layer_tensors_are_left_out(tmp_path):
    """A V3 checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*) loads without
    it, as transformers does; the same tensor past the MTP layers is refused as unused."""
    mtp_tensors_left_out(tmp_path, "deepseek_v3")


def mtp_tensors_left_out(tmp_path, name: str) -> None:
    """The fixture `name` (3 layers, num_nextn_predict_layers 1) with an MTP tensor added
    loads (the tensor unread); with the tensor one layer further it is refused as unused."""
    import json
    import shutil

    from metrale.errors import FormatError
    from metrale.formats import DirectorySource
    from tests.formats.st_util import tensors_bytes
    src = FIXTURES / name
    stored = DirectorySource(src)
    tensors = {n: ("BF16", np.asarray(stored.read_bf16(n))) for n in stored.tensor_names()}
    for extra, ok in (("model.layers.3.enorm.weight", True),
                      ("model.layers.4.enorm.weight", False)):
        d = tmp_path / extra
        shutil.copytree(src, d)
        t = dict(tensors, **{extra: ("BF16", np.full(64, 0x3F80, np.uint16))})
        (d / "model.safetensors").write_bytes(tensors_bytes(t))
        # absent (glm4_moe_lite saves none): 1, as deepseek_config.mtp_prefixes reads it
        cfg = json.loads((d / "config.json").read_text())
        assert cfg.get("num_nextn_predict_layers", 1) == 1
        if ok:
            metrale.load(d, "cpu", progress=False).teardown()
        else:
            with pytest.raises(FormatError, match="model.layers.4.enorm.weight"):
                metrale.load(d, "cpu", progress=False)
