"""WhisperModel on HostBackend against the HF goldens of the whisper_tiny fixture."""
import numpy as np
import pytest

import metrale
from metrale.errors import InvalidArgument, MetraleError
from metrale.generative import SpeechToTextModel
from metrale.gpu_runtime import HostBackend
from tests.conftest import TOL
from tests.model.common import assert_matches_golden
from tests.whisper.common import FIXTURE, golden, load, rel_err

REL = TOL["model_vs_golden_rel_max"][0]


@pytest.fixture(scope="module")
def model():
    m = load()
    yield m
    m.close()


@pytest.fixture(scope="module")
def gold():
    return golden()


@pytest.fixture(scope="module")
def encoded(model, gold):
    return model.encode_audio(gold["mel"])


def test_load_returns_speech_to_text_model(model):
    assert isinstance(model, SpeechToTextModel)
    assert model.metadata().architecture == "whisper"
    assert model.n_mels() == 80
    assert model.max_frames() == 200
    gen = metrale.load_generative(FIXTURE, HostBackend(), progress=False)
    assert isinstance(gen, SpeechToTextModel) and gen.n_mels() == 80
    gen.close()


def test_encoder_matches_golden(encoded, gold):
    assert encoded.shape == (1, 100, 64) and encoded.dtype == np.float32
    err = rel_err(encoded[0], gold["encoder"])
    assert err < REL, f"encoder relative max error {err:.4f}"


def test_teacher_forced_logits_every_prefix(model, encoded, gold):
    ids = gold["decoder_input_ids"][0].tolist()
    want = gold["decoder_logits"]
    for i in range(1, len(ids) + 1):
        got = model.decode_step(ids[:i], encoded)
        assert got.shape == (model.vocab_size(),) and got.dtype == np.float32
        assert_matches_golden(got, want[i - 1], f"prefix {i}")


def test_decoder_on_golden_encoder_states(model, gold):
    """The decoder alone, fed HF's fp32 encoder states."""
    enc = gold["encoder"][None].astype(np.float32)
    ids = gold["decoder_input_ids"][0].tolist()
    assert_matches_golden(model.decode_step(ids, enc), gold["decoder_logits"][-1], "last")


def test_cached_steps_equal_uncached_recomputation(model, encoded, gold):
    ids = gold["decoder_input_ids"][0].tolist()
    model.reset_cache()
    cached = [model.decode_step(ids[:i], encoded) for i in range(1, len(ids) + 1)]
    for i in range(1, len(ids) + 1):
        fresh = encoded.copy()  # a new array: no cached state, recomputed from scratch
        model.reset_cache()
        assert np.array_equal(model.decode_step(ids[:i], fresh), cached[i - 1]), i


def test_diverging_prefix_recomputes_the_tail(model, encoded, gold):
    ids = gold["decoder_input_ids"][0].tolist()
    alt = ids[:5] + [3, 9, 11]
    model.reset_cache()
    model.decode_step(ids, encoded)
    got = model.decode_step(alt, encoded)       # shares 5 rows with the previous call
    same = model.decode_step(alt, encoded)      # the same tokens again
    model.reset_cache()
    want = model.decode_step(alt, encoded.copy())
    assert np.array_equal(got, want) and np.array_equal(same, want)


def test_window_cache_is_bounded_and_keyed_by_identity(gold):
    m = load(window_cache=2)
    try:
        encs = [m.encode_audio(gold["mel"]) for _ in range(3)]
        ids = gold["decoder_input_ids"][0].tolist()[:4]
        outs = [m.decode_step(ids, e) for e in encs]
        assert m.cached_windows() == 2
        assert all(np.array_equal(o, outs[0]) for o in outs)
        b = m.backend
        m.close()
        assert b.live_bytes() == 0
    finally:
        m.close()


def test_fewer_and_odd_frames(model, gold):
    assert model.encode_audio(gold["mel"][:, :, :120]).shape == (1, 60, 64)
    assert model.encode_audio(gold["mel"][:, :, :7]).shape == (1, 4, 64)


@pytest.mark.parametrize("mel_shape,match", [((1, 64, 200), "n_mels is 80"),
                                             ((1, 80, 201), r"\[1, 200\]"),
                                             ((80, 200), r"\[1, n_mels, frames\]"),
                                             ((2, 80, 200), r"\[1, n_mels, frames\]"),
                                             ((1, 80, 0), "frames")])
def test_bad_mel_raises(model, mel_shape, match):
    with pytest.raises(InvalidArgument, match=match):
        model.encode_audio(np.zeros(mel_shape, np.float32))


def test_non_finite_mel_raises(model, gold):
    mel = gold["mel"].copy()
    mel[0, 3, 5] = np.nan
    with pytest.raises(InvalidArgument, match="NaN"):
        model.encode_audio(mel)


@pytest.mark.parametrize("tokens,match", [([], "0 tokens"), ([250, 256], "vocab_size"),
                                          ([250, -1], "vocab_size"), ([250, 1.5], "not an int"),
                                          (list(range(65)), "max_target_positions"),
                                          ("abc", "not an int")])
def test_bad_tokens_raise(model, encoded, tokens, match):
    with pytest.raises(InvalidArgument, match=match):
        model.decode_step(tokens, encoded)


@pytest.mark.parametrize("shape", [(1, 100, 32), (100, 64), (1, 101, 64), (1, 0, 64)])
def test_bad_encoded_raises(model, shape):
    with pytest.raises(InvalidArgument, match="encoded"):
        model.decode_step([250], np.zeros(shape, np.float32))


def test_bad_options_raise():
    with pytest.raises(MetraleError, match="window_cache"):
        load(window_cache=0)
    with pytest.raises(MetraleError, match="unknown option"):
        load(bogus=1)


def test_close_frees_every_byte(gold):
    b = HostBackend()
    m = load(b)
    enc = m.encode_audio(gold["mel"])
    m.decode_step([250, 252], enc)
    m.close()
    assert b.live_bytes() == 0
