"""LLaVA on HostBackend: golden HF logits with an image span and text only, through the
pointer API (`ModelVision`) and the tensor contract (`embed_multimodal`); the tower against
an independent float64 reference for each feature layer / strategy / activation; every
mismatch a MetraleError raised before a launch."""
import json

import numpy as np
import pytest

import metrale
from metrale.errors import InvalidArgument, MetraleError, UnsupportedMedia
from metrale.formats import MemorySource
from metrale.gpu_runtime import HostBackend
from metrale.vision import ImageProcessorConfig, preprocess_image
from metrale.vision.generative import LlavaGenerativeModel
from metrale.vision.llava import LlavaModel
from tests.model.common import (FIXTURES, assert_matches_golden, golden, load, logits_rows,
                                rel_err)
from tests.vision.reference import image_features

NAME = "llava_tiny"
IMG = 255


@pytest.fixture(scope="module")
def g():
    return golden(NAME)


@pytest.fixture
def model():
    return load(NAME)


@pytest.fixture
def gen(model):
    return LlavaGenerativeModel(model)


def _spans(ids):
    return np.flatnonzero(np.asarray(ids) == IMG)


# ----------------------------------------------------------------------------- loading
def test_load_returns_llava_transformer(model):
    assert isinstance(model, LlavaModel)
    assert isinstance(model, metrale.model_engine.TransformerModel)
    assert model.metadata().architecture == "llava"
    assert model.num_image_features() == 16 and model.image_token_index() == IMG
    assert model.image_input_shape() == (1, 3, 32, 32)
    assert model.image_features_ptr().is_null()
    assert isinstance(model.image_processor_config(), ImageProcessorConfig)
    assert model.image_processor_config().crop_height == 32


def test_load_generative_is_multimodal():
    m = metrale.load_generative(FIXTURES / NAME, HostBackend(), progress=False)
    assert isinstance(m, LlavaGenerativeModel)


def test_contract_load_classmethod_builds_the_llava_model(g):
    # `GenerativeModel.load` (the seed's `load`) builds its own model, without metrale.api
    m = LlavaGenerativeModel.load(FIXTURES / NAME, HostBackend(), progress=False)
    assert isinstance(m, LlavaGenerativeModel) and isinstance(m.model, LlavaModel)
    emb = metrale.to_numpy(m.embed_multimodal(g["input_ids"], [g["pixel_values"]]))
    ref = LlavaGenerativeModel(load(NAME)).embed_multimodal(g["input_ids"], [g["pixel_values"]])
    np.testing.assert_array_equal(emb, metrale.to_numpy(ref))
    with pytest.raises(metrale.Unsupported, match="not llava"):
        LlavaGenerativeModel.load(FIXTURES / "llama_gqa", HostBackend(), progress=False)


def test_teardown_frees_every_byte():
    be = HostBackend()
    m = load(NAME, be)
    m.encode_images([np.zeros((1, 3, 32, 32), np.float32)] * 3, m.default_stream())
    m.teardown()
    assert be.live_bytes() == 0


# ----------------------------------------------------------------------------- golden
def test_pointer_prefill_multimodal_matches_golden(model, g):
    ids = g["input_ids"][0].tolist()
    s = model.default_stream()
    feats = model.encode_images([g["pixel_values"]], s)
    assert feats == model.image_features_ptr()
    seq = model.alloc_sequence()
    ptr = model.prefill_multimodal(ids, feats, seq, s)
    assert seq.seq_len == len(ids)
    assert_matches_golden(logits_rows(model, ptr), g["logits"][-1], "llava prefill_multimodal")
    # image positions are embedding-fed: never offered to the prefix cache
    assert [t for t in seq.tokens if t < 0] == [-1] * 16
    assert model.cache_sequence(seq) == 0


@pytest.mark.parametrize("splits", [(3, 13, 27), (8, 27), (27,)])
def test_pointer_chunks_then_decode_match_golden(model, g, splits):
    ids = g["input_ids"][0].tolist()
    n = len(ids)
    s = model.default_stream()
    feats = model.encode_images([g["pixel_values"]], s)
    seq = model.alloc_sequence()
    bounds = [0, *splits]
    for a, b in zip(bounds[:-1], bounds[1:]):
        p = model.prefill_chunk_multimodal(ids[:bounds[-1]], feats, seq, a, b - a,
                                           b == bounds[-1], s)
    assert_matches_golden(logits_rows(model, p), g["logits"][bounds[-1] - 1], "llava chunks")
    rows = [logits_rows(model, model.decode(ids[t], seq, s))[0] for t in range(bounds[-1], n)]
    if rows:
        assert_matches_golden(np.stack(rows), g["logits"][bounds[-1]:], "llava decode")


def test_small_prefill_workspace_splits_spans(g):
    m = load(NAME, max_prefill_tokens=5)  # spans cross several internal passes
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    p = m.prefill_multimodal(ids, m.encode_images([g["pixel_values"]], s), m.alloc_sequence(), s)
    assert_matches_golden(logits_rows(m, p), g["logits"][-1], "llava max_prefill_tokens=5")


def test_tensor_api_matches_golden(gen, g):
    emb = gen.embed_multimodal(g["input_ids"], [g["pixel_values"]])
    assert emb.shape == (1, g["input_ids"].shape[1], 64) and emb.dtype == np.float32
    cache = gen.create_kv_cache()
    n = emb.shape[1]
    logits = gen.prefill_all_logits(emb, cache, range(0, n))
    err = rel_err(logits[0], g["logits"])
    assert err < 0.03, err
    assert_matches_golden(logits[0], g["logits"], "llava prefill_all_logits")
    cache.reset()
    last = gen.prefill(emb, cache, range(0, n))
    assert_matches_golden(last, g["logits"][-1], "llava tensor prefill")
    # text rows equal plain embeddings; span rows equal the pointer API's features
    plain = gen.embed(g["input_ids"])
    mask = g["input_ids"][0] == IMG
    assert np.array_equal(emb[0, ~mask], plain[0, ~mask])
    m = gen.model
    bits = np.empty((16, 64), np.uint16)
    m.backend.copy_d2h(m.encode_images([g["pixel_values"]], 0), bits)
    from metrale.ops.bf16 import bf16_to_f32
    assert np.array_equal(emb[0, mask], bf16_to_f32(bits))


def test_text_only_matches_golden(model, gen, g):
    t = g["text_input_ids"]
    s = model.default_stream()
    p = model.prefill(t[0].tolist(), model.alloc_sequence(), s)
    assert_matches_golden(logits_rows(model, p), g["text_logits"][-1], "llava text prefill")
    p2 = model.prefill_multimodal(t[0].tolist(), 0, model.alloc_sequence(), s)  # no spans
    assert_matches_golden(logits_rows(model, p2), g["text_logits"][-1], "llava text mm")
    emb = gen.embed_multimodal(t, [])
    assert np.array_equal(emb, gen.embed(t))
    cache = gen.create_kv_cache()
    logits = gen.prefill_all_logits(emb, cache, range(0, t.shape[1]))
    assert_matches_golden(logits[0], g["text_logits"], "llava text prefill_all_logits")


def test_two_images_in_one_prompt(model, gen, g):
    """Two spans (separated, and back to back) take their own image's features, in order."""
    rng = np.random.default_rng(3)
    a, b = g["pixel_values"], rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    ids = np.array([[1, 7] + [IMG] * 16 + [9, 10] + [IMG] * 16 + [11]], np.int32)
    emb = gen.embed_multimodal(ids, [a, b])
    one_a = gen.embed_multimodal(np.array([[IMG] * 16]), [a])[0]
    one_b = gen.embed_multimodal(np.array([[IMG] * 16]), [b])[0]
    pos = _spans(ids[0])
    assert np.array_equal(emb[0, pos[:16]], one_a) and np.array_equal(emb[0, pos[16:]], one_b)
    back = np.array([[1] + [IMG] * 32 + [5]], np.int32)
    emb2 = gen.embed_multimodal(back, [b, a])
    assert np.array_equal(emb2[0, 1:17], one_b) and np.array_equal(emb2[0, 17:33], one_a)
    # the pointer API gives the same last logits as the tensor API
    s = model.default_stream()
    p = model.prefill_multimodal(ids[0], model.encode_images([a, b], s), model.alloc_sequence(), s)
    cache = gen.create_kv_cache()
    want = gen.prefill(emb, cache, range(0, ids.shape[1]))
    np.testing.assert_array_equal(logits_rows(model, p)[0], want[0])


def test_preprocess_with_model_config(gen, model):
    img = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    px = preprocess_image(img, gen)
    assert px.shape == model.image_input_shape()
    assert np.array_equal(px, preprocess_image(img, model))
    gen.embed_multimodal(np.array([[1] + [IMG] * 16]), [px])


# ----------------------------------------------------------------------------- the tower
def _variant_config(**changes):
    cfg = json.loads((FIXTURES / NAME / "config.json").read_text())
    vis = changes.pop("vision", {})
    cfg["vision_config"].update(vis)
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes", [
    {},
    {"vision_feature_select_strategy": "full"},
    {"vision_feature_layer": -1, "vision": {"hidden_act": "gelu"}},
    {"vision_feature_layer": 0, "vision_feature_select_strategy": "full"},
    {"vision_feature_layer": 1, "projector_hidden_act": "gelu_pytorch_tanh",
     "vision": {"patch_size": 4, "image_size": 16}},
    {"multimodal_projector_bias": False},
], ids=["default", "full", "last-gelu", "layer0-full", "layer1-p4-tanh", "no-proj-bias"])
def test_tower_matches_float64_reference(changes):
    src = MemorySource(_variant_config(**changes), seed=4)
    m = LlavaModel(HostBackend(), src, kv_blocks=8, progress=False)
    v = src.metadata().vision
    F = v.num_image_tokens
    assert m.num_image_features() == F
    rng = np.random.default_rng(9)
    pics = [rng.standard_normal((1, 3, v.image_size, v.image_size)).astype(np.float32)
            for _ in range(2)]
    ptr = m.encode_images(pics, m.default_stream())
    bits = np.empty((2 * F, v.text_hidden_size), np.uint16)
    m.backend.copy_d2h(ptr, bits)
    from metrale.ops.bf16 import bf16_to_f32
    got = bf16_to_f32(bits).reshape(2, F, -1)
    for i in range(2):
        ref = image_features(src, pics[i])
        assert ref.shape == got[i].shape
        assert rel_err(got[i], ref) < 0.03, (changes, i, rel_err(got[i], ref))
    # a full-strategy prompt takes F = patches + 1 tokens per image
    ids = [1] + [v.image_token_index] * F + [3]
    p = m.prefill_multimodal(ids, ptr, m.alloc_sequence(), m.default_stream())
    assert np.isfinite(logits_rows(m, p)).all()


def test_bad_feature_layer_is_a_format_error():
    with pytest.raises(MetraleError, match="vision_feature_layer"):
        LlavaModel(HostBackend(), MemorySource(_variant_config(vision_feature_layer=-4)),
                   kv_blocks=8, progress=False)


# ----------------------------------------------------------------------------- mismatches
def test_span_and_image_count_mismatches(gen, g):
    px = g["pixel_values"]
    ids = g["input_ids"]
    with pytest.raises(InvalidArgument, match="1 image span.*2 image"):
        gen.embed_multimodal(ids, [px, px])
    with pytest.raises(InvalidArgument, match="1 image span.*0 image"):
        gen.embed_multimodal(ids, [])
    with pytest.raises(InvalidArgument, match="0 image span.*1 image"):
        gen.embed_multimodal(g["text_input_ids"], [px])
    short = np.array([[1] + [IMG] * 15 + [4]], np.int32)
    with pytest.raises(InvalidArgument, match="15 image tokens"):
        gen.embed_multimodal(short, [px])
    long = np.array([[1] + [IMG] * 17 + [4]], np.int32)
    with pytest.raises(InvalidArgument, match="17 image tokens"):
        gen.embed_multimodal(long, [px])
    with pytest.raises(InvalidArgument, match=r"\[1, seq\]"):
        gen.embed_multimodal(np.concatenate([ids, ids]), [px])


def test_image_shape_and_type_mismatches(gen, model, g):
    ids = g["input_ids"]
    for bad in (np.zeros((3, 32, 32), np.float32), np.zeros((1, 3, 16, 16), np.float32),
                np.zeros((1, 1, 32, 32), np.float32), np.zeros((2, 3, 32, 32), np.float32)):
        with pytest.raises(InvalidArgument, match=r"shape \[1, 3, 32, 32\]"):
            gen.embed_multimodal(ids, [bad])
        with pytest.raises(InvalidArgument, match="shape"):
            model.encode_images([bad], 0)
    with pytest.raises(InvalidArgument, match="float"):
        gen.embed_multimodal(ids, [np.zeros((1, 3, 32, 32), np.uint8)])
    nan = np.full((1, 3, 32, 32), np.nan, np.float32)
    with pytest.raises(InvalidArgument, match="NaN"):
        model.encode_images([nan], 0)
    with pytest.raises(InvalidArgument, match="list"):
        gen.embed_multimodal(ids, g["pixel_values"])  # one array, not a list of them
    with pytest.raises(InvalidArgument, match="no images"):
        model.encode_images([], 0)


def test_pointer_api_mismatches(model, g):
    ids = g["input_ids"][0].tolist()
    s = model.default_stream()
    with pytest.raises(InvalidArgument, match="NULL"):
        model.prefill_multimodal(ids, 0, model.alloc_sequence(), s)
    feats = model.encode_images([g["pixel_values"]], s)
    two = [1] + [IMG] * 16 + [4] + [IMG] * 16
    with pytest.raises(InvalidArgument, match="need 32 feature rows"):
        model.prefill_multimodal(two, feats, model.alloc_sequence(), s)
    with pytest.raises(InvalidArgument, match="need 16 feature rows"):
        model.prefill_multimodal(ids, feats.offset(64 * 2), model.alloc_sequence(), s)
    with pytest.raises(InvalidArgument, match="boundary"):
        model.prefill_multimodal(ids, feats.offset(2), model.alloc_sequence(), s)
    with pytest.raises(InvalidArgument, match="15 image tokens"):
        model.prefill_multimodal([1] + [IMG] * 15, feats, model.alloc_sequence(), s)
    seq = model.alloc_sequence()
    with pytest.raises(InvalidArgument, match="token id 256"):
        model.prefill_multimodal(ids + [256], feats, seq, s)
    assert seq.seq_len == 0 and model.num_free_blocks() == model.num_total_blocks()


def test_images_to_text_only_model(g):
    gm = metrale.load_generative(FIXTURES / "llama_gqa", HostBackend(), progress=False)
    with pytest.raises(UnsupportedMedia, match="1 image"):
        gm.embed_multimodal(g["text_input_ids"] % 200, [g["pixel_values"]])
    assert isinstance(UnsupportedMedia("x"), metrale.MetraleError)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_llava_on_cuda_matches_golden(device, g):
    m = load(NAME, device)
    ids = g["input_ids"][0].tolist()
    s = m.default_stream()
    p = m.prefill_multimodal(ids, m.encode_images([g["pixel_values"]], s), m.alloc_sequence(), s)
    assert_matches_golden(logits_rows(m, p), g["logits"][-1], "llava cuda")
    gen = LlavaGenerativeModel(m)
    emb = metrale.to_numpy(gen.embed_multimodal(g["input_ids"], [g["pixel_values"]]))
    host = LlavaGenerativeModel(load(NAME)).embed_multimodal(g["input_ids"], [g["pixel_values"]])
    assert rel_err(emb, host) < 0.02
