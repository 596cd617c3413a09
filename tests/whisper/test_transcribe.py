"""transcribe(): prompt from generation_config, suppress rules, eos, 30 s windows."""
from dataclasses import replace

import numpy as np
import pytest

from metrale.engine.transcribe import Transcription, transcribe
from metrale.errors import InvalidArgument
from metrale.formats import open_source
from metrale.generative import SpeechToTextModel
from tests.whisper.common import FIXTURE, golden, load

SOT, EN, DE, TRANSCRIBE, TRANSLATE, NOTS, EOS = 250, 252, 253, 254, 249, 255, 251


class FakeModel(SpeechToTextModel):
    """Scripted logits: `script(tokens) -> {id: score}`; records every call."""

    def __init__(self, script, **whisper_changes):
        meta = open_source(FIXTURE).metadata()
        self.meta = replace(meta, whisper=replace(meta.whisper, **whisper_changes))
        self.script = script
        self.calls, self.encoded = [], []

    def metadata(self):
        return self.meta

    def n_mels(self):
        return 80

    def encode_audio(self, mel):
        assert mel.shape == (1, 80, 200)
        self.encoded.append(mel)
        return np.zeros((1, 100, 64), np.float32)

    def decode_step(self, tokens, encoded):
        self.calls.append(list(tokens))
        logits = np.zeros(self.meta.vocab_size, np.float32)
        for t, v in self.script(list(tokens)).items():
            logits[t] = v
        return logits


def counting(n_out, first=10):
    """Emit first, first+1, ... then eos after n_out tokens."""
    def script(tokens):
        gen = len(tokens) - 4
        return {EOS: 100.0} if gen >= n_out else {first + gen: 50.0}
    return script


def test_prompt_from_generation_config_and_eos():
    m = FakeModel(counting(3))
    r = transcribe(m, np.zeros(16000, np.float32))
    assert isinstance(r, Transcription)
    assert m.calls[0] == [SOT, EN, TRANSCRIBE, NOTS]  # forced language <|en|>
    assert r.tokens == [10, 11, 12] and r.text is None and r.language == "<|en|>"
    assert len(r.segments) == 1 and r.segments[0].end == pytest.approx(1.0)


def test_explicit_language_and_task():
    m = FakeModel(counting(1))
    transcribe(m, np.zeros(1600, np.float32), language="de", task="translate")
    assert m.calls[0] == [SOT, DE, TRANSLATE, NOTS]
    m = FakeModel(counting(1))
    transcribe(m, np.zeros(1600, np.float32), language="<|de|>")
    assert m.calls[0] == [SOT, DE, TRANSCRIBE, NOTS]


def test_language_detected_when_not_forced():
    m = FakeModel(lambda t: {DE: 9.0, EN: 1.0} if t == [SOT] else {EOS: 1.0},
                  forced_decoder_ids=())
    r = transcribe(m, np.zeros(1600, np.float32))
    assert m.calls[0] == [SOT] and m.calls[1] == [SOT, DE, TRANSCRIBE, NOTS]
    assert r.language == "<|de|>"


def test_english_only_prompt():
    m = FakeModel(counting(1), lang_to_id={}, task_to_id={}, forced_decoder_ids=())
    transcribe(m, np.zeros(1600, np.float32))
    assert m.calls[0] == [SOT, NOTS]
    with pytest.raises(InvalidArgument, match="translate"):
        transcribe(m, np.zeros(1600, np.float32), task="translate")


def test_suppress_and_begin_suppress():
    # suppress_tokens 5,6,7 always; begin_suppress 4 and eos (251) at the first step only
    def script(tokens):
        gen = len(tokens) - 4
        if gen == 0:
            return {EOS: 99.0, 4: 98.0, 5: 97.0, 20: 1.0}
        if gen == 1:
            return {6: 99.0, 4: 50.0}
        return {EOS: 9.0, 7: 10.0}
    r = transcribe(FakeModel(script), np.zeros(1600, np.float32))
    assert r.tokens == [20, 4]


def test_max_new_tokens():
    m = FakeModel(counting(1000))
    assert len(transcribe(m, np.zeros(1600, np.float32), max_new_tokens=5).tokens) == 5
    # also bounded by max_target_positions (64) minus the 4 prompt tokens
    assert len(transcribe(m, np.zeros(1600, np.float32), max_new_tokens=500).tokens) == 60


def test_65_seconds_make_three_windows():
    m = FakeModel(counting(2))
    r = transcribe(m, np.zeros(65 * 16000, np.float32), tokenizer=StubTokenizer())
    assert len(m.encoded) == 3 and len(r.segments) == 3
    assert [(s.start, s.end) for s in r.segments] == [(0.0, 30.0), (30.0, 60.0), (60.0, 65.0)]
    assert r.tokens == [10, 11] * 3
    assert r.segments[1].text == "t10 t11" and r.text == "t10 t11 t10 t11 t10 t11"


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(audio=np.zeros((16000, 2), np.float32)), "mono"),
    (dict(audio=np.zeros(0, np.float32)), "empty"),
    (dict(audio=np.zeros(16000, np.float32), sampling_rate=44100), "sampling_rate"),
    (dict(audio=np.zeros(1600, np.float32), task="summarize"), "task"),
    (dict(audio=np.zeros(1600, np.float32), language="xx"), "unknown language"),
    (dict(audio=np.zeros(1600, np.float32), max_new_tokens=0), "max_new_tokens")])
def test_bad_input_raises(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        transcribe(FakeModel(counting(1)), **kwargs)


def test_real_model_greedy_matches_hf():
    """Greedy ids of the fixture model on its golden audio, as HF's model gives them (a
    by-hand torch loop with the same prompt and suppress rules: 39 x 20)."""
    m = load()
    try:
        r = transcribe(m, golden()["audio"], max_new_tokens=20)
        assert r.tokens == [39] * 20
        assert m.cached_windows() == 1
    finally:
        m.close()


def test_real_model_wav_path_and_long_audio(tmp_path):
    from tests.whisper.test_audio import write_wav
    g = golden()
    write_wav(tmp_path / "a.wav", g["audio"], 16000)
    m = load()
    try:
        r = transcribe(m, tmp_path / "a.wav", max_new_tokens=3)
        assert r.tokens == [39, 39, 39]
        long = np.tile(g["audio"], 33)[:65 * 16000]
        r = transcribe(m, long, max_new_tokens=2)
        assert len(r.segments) == 3 and len(r.tokens) == 6
    finally:
        m.close()
