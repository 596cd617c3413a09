"""GLM-4.5 (`glm4_moe`: GQA + DeepSeek's MoE block) and GLM-4.7-Flash (`glm4_moe_lite`:
DeepSeek-V3's MLA + MoE under GLM's names) against golden transformers fp32 logits of tiny
random checkpoints (tests/fixtures/make_glm4_moe_fixtures.py), through every forward path
of the shared golden suite (its tests re-run here on these fixtures) and the tensor API,
plus: each GLM feature neutralised moves the logits past the golden tolerance (the fixtures
test what they claim), the MTP layers are left unread, and what is refused."""
from dataclasses import replace

import pytest

from metrale.errors import Unsupported
from metrale.gpu_runtime import backend
from metrale.gpu_runtime.types import NULL
from tests.generative import test_tensor_api as tensor_api
from tests.model.common import assert_matches_golden, golden, load, rel_err
from tests.model.test_deepseek import (BACKENDS, _neutralise, mtp_tensors_left_out,
                                       teacher_forced)
from tests.model.test_golden import (  # noqa: F401 (re-run on the GLM fixtures)
    test_batched_prefill_defaults_place_rows, test_chunked_prefill_equals_whole_prefill_bits,
    test_decode_batch_mixed_lengths_is_batch_invariant, test_decode_verify_rows_equal_decode_steps,
    test_fp32_logits_and_graphs, test_prefill_chunks_then_teacher_forced_decode,
    test_prefill_last_logits)

GLM_FIXTURES = ["glm4_moe", "glm4_moe_lite"]


@pytest.fixture(params=BACKENDS)
def device_name(request):
    return request.param


@pytest.fixture(params=GLM_FIXTURES)
def case(request, device_name):
    name = request.param
    return name, load(name, backend(device_name)), golden(name)


def _neutralise_attention(m, feature):
    """glm4_moe's attention features off: the rope over every head dim (its tables made
    again at that width), no q/k norm, no q/k/v biases."""
    if feature == "partial rotary":
        m._meta = m._layer_meta = replace(m._meta, variant=replace(m._meta.variant,
                                                                   rotary_dim=0))
        m._layer_rope.clear()
        m._upload_rope_tables(m._meta)
    for L in m._weights.layers:
        if feature == "qk norm":
            L.q_norm = L.k_norm = NULL
        elif feature == "attention bias":
            L.qkv_bias = NULL


@pytest.mark.parametrize("name, feature", [
    ("glm4_moe", "partial rotary"), ("glm4_moe", "qk norm"), ("glm4_moe", "attention bias"),
    ("glm4_moe", "correction bias"), ("glm4_moe", "group limit"),
    ("glm4_moe", "routed_scaling_factor"), ("glm4_moe", "norm_topk_prob"),
    ("glm4_moe", "shared experts"), ("glm4_moe_lite", "correction bias"),
    ("glm4_moe_lite", "group limit"), ("glm4_moe_lite", "routed_scaling_factor"),
    ("glm4_moe_lite", "shared experts"), ("glm4_moe_lite", "rope pairs")])
def test_each_feature_moves_the_logits(name, feature):
    g = golden(name)
    ids = g["input_ids"][0].tolist()
    m = load(name, fp32_logits=True)
    assert_matches_golden(teacher_forced(m, ids), g["logits"][5:], name)
    if feature in ("partial rotary", "qk norm", "attention bias"):
        _neutralise_attention(m, feature)
    else:   # the MoE block's and MLA's features (test_deepseek.py)
        _neutralise(m, feature)
    err = rel_err(teacher_forced(m, ids), g["logits"][5:])
    assert err > 0.03, f"{name}: without {feature} the logits move only {err:.4f}"


@pytest.mark.parametrize("name, kind", [("glm4_moe", "paged"), ("glm4_moe", "contiguous"),
                                        ("glm4_moe_lite", "paged")])
def test_tensor_api_matches_golden_and_pointer_api(name, kind):
    tensor_api.test_prefill_and_decode_match_golden_and_pointer_api(name, kind)


def test_glm4_moe_runs_the_gqa_path_with_a_partial_rope():
    """glm4_moe: the GQA block (no latent attention), rope tables of 16 of the 32 dims, a
    KV pool of K and V for the 2 kv heads."""
    m = load("glm4_moe", kv_blocks=10, block_size=16)
    meta = m._meta
    assert meta.mla is None and meta.moe.deepseek.correction_bias and meta.qk_norm
    assert (meta.num_heads, meta.num_kv_heads, meta.head_dim, meta.variant.rotary_dim) == \
        (4, 2, 32, 16)
    assert m._ws.block_bytes == 16 * 2 * 32 * 2
    m.teardown()


@pytest.mark.parametrize("name", GLM_FIXTURES)
def test_mtp_layer_tensors_are_left_out(tmp_path, name):
    """GLM's MTP layer (model.layers.{num_hidden_layers}.*) loads unread, as transformers
    leaves it; asking for it as a draft proposer is refused by name."""
    mtp_tensors_left_out(tmp_path, name)
    with pytest.raises(Unsupported, match=f"mtp=True: {name} has no multi-token-prediction"):
        load(name, mtp=True)


def test_info_describes_the_deepseek_router(capsys):
    """`metrale info` states the routing the model runs: the sigmoid router with its
    correction bias and groups, the scaling, an ungated shared expert."""
    import json

    from metrale.cli import main
    from tests.model.common import FIXTURES
    assert main(["info", str(FIXTURES / "glm4_moe"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_bytes_per_token"] == 3 * 2 * 2 * 32 * 2   # layers * K,V * kv heads * D
    math = info["math"]
    assert math["experts"].startswith("8 experts of width 32, top-2 of a float32 sigmoid + "
                                      "e_score_correction_bias (choice only) in the best 2 of "
                                      "4 expert groups, renormalised, times 2.5, plus a shared "
                                      "expert of width 32 (ungated)")
    assert math["rotary_dims"].startswith("the first 16 of each head's 32")
