"""The audio front end: log-mel against HF's WhisperFeatureExtractor, WAV reading,
resampling, bad input."""
import wave

import numpy as np
import pytest

from metrale import audio
from metrale.errors import InvalidArgument, MetraleError, UnsupportedMedia
from tests.whisper.common import golden


def write_wav(path, samples, rate, width=2):
    """samples: float [n] or [n, channels] in [-1, 1]."""
    x = np.asarray(samples, np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if width == 2:
        raw = np.round(np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    elif width == 1:
        raw = np.round(np.clip(x, -1, 1) * 127 + 128).astype(np.uint8).tobytes()
    else:
        raise ValueError(width)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(x.shape[1])
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(raw)


def sine(freq, rate, seconds):
    t = np.arange(int(rate * seconds)) / rate
    return 0.5 * np.sin(2 * np.pi * freq * t)


def test_log_mel_matches_feature_extractor():
    g = golden()
    mel = audio.log_mel_spectrogram(g["audio"], n_mels=80)
    assert mel.shape == (80, int(g["mel_full_frames"])) and mel.dtype == np.float32
    frames = g["mel"].shape[-1]
    assert np.max(np.abs(mel[:, :frames] - g["mel"][0])) < 2e-2


def test_log_mel_shapes_and_floor():
    x = sine(440, 16000, 3.0).astype(np.float32)
    assert audio.log_mel_spectrogram(x, n_mels=128).shape == (128, 3000)
    assert audio.log_mel_spectrogram(x, padding_to_30s=False).shape == (80, 300)
    long = np.tile(x, 12)  # 36 s: cut to 30 s like the extractor
    assert audio.log_mel_spectrogram(long).shape == (80, 3000)
    mel = audio.log_mel_spectrogram(x)
    assert mel.min() >= mel.max() - 2.0 - 1e-6  # floor at max - 8 before (x + 4) / 4


def test_mel_filters_slaney():
    fb = audio.mel_filters(80)
    assert fb.shape == (201, 80)
    assert np.all(fb >= 0) and np.all(fb.max(axis=0) > 0)
    assert np.all(np.diff(fb.argmax(axis=0)) >= 0)  # centres increase with the filter index


@pytest.mark.parametrize("bad,match", [(np.zeros((100, 2), np.float32), "mono"),
                                       (np.zeros(0, np.float32), "empty"),
                                       (np.array([0.0, np.nan], np.float32), "NaN"),
                                       (np.zeros(100, np.int16), "float")])
def test_bad_audio_raises(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        audio.log_mel_spectrogram(bad)


def test_wrong_sample_rate_raises():
    with pytest.raises(InvalidArgument, match="sampling_rate"):
        audio.log_mel_spectrogram(np.zeros(1000, np.float32), sampling_rate=44100)


def test_bad_n_mels_raises():
    with pytest.raises(InvalidArgument, match="n_mels"):
        audio.log_mel_spectrogram(np.zeros(1000, np.float32), n_mels=0)


def test_load_wav_16k_roundtrip(tmp_path):
    x = sine(440, 16000, 0.5)
    write_wav(tmp_path / "a.wav", x, 16000)
    got = audio.load_wav(tmp_path / "a.wav")
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.max(np.abs(got - x)) < 1.5 / 32768


def test_load_wav_8bit(tmp_path):
    x = sine(300, 16000, 0.1)
    write_wav(tmp_path / "a.wav", x, 16000, width=1)
    assert np.max(np.abs(audio.load_wav(tmp_path / "a.wav") - x)) < 1.5 / 128


@pytest.mark.parametrize("rate", [44100, 8000, 22050])
def test_load_wav_resamples(tmp_path, rate):
    write_wav(tmp_path / "a.wav", sine(1000, rate, 1.0), rate)
    got = audio.load_wav(tmp_path / "a.wav")
    assert got.size == 16000
    want = sine(1000, 16000, 1.0)
    mid = slice(800, 15200)  # away from the edges
    assert np.max(np.abs(got[mid] - want[mid])) < 5e-3


def test_resample_removes_content_above_the_new_nyquist():
    x = sine(12000, 44100, 1.0)  # above 8 kHz: must vanish at 16 kHz
    y = audio.resample(x, 44100, 16000)
    assert np.max(np.abs(y[800:-800])) < 1e-2


def test_load_wav_without_resampling_raises(tmp_path):
    write_wav(tmp_path / "a.wav", sine(1000, 44100, 0.1), 44100)
    with pytest.raises(UnsupportedMedia, match="44100 Hz"):
        audio.load_wav(tmp_path / "a.wav", resample_to=None)


def test_load_wav_stereo_is_downmixed_by_default(tmp_path):
    x = np.stack([sine(440, 16000, 0.2), sine(440, 16000, 0.2) * 0.5], axis=1)
    write_wav(tmp_path / "s.wav", x, 16000)
    got = audio.load_wav(tmp_path / "s.wav")
    assert np.max(np.abs(got - x.mean(axis=1))) < 2 / 32768
    with pytest.raises(UnsupportedMedia, match="2 channels"):
        audio.load_wav(tmp_path / "s.wav", downmix=False)


def test_load_wav_unreadable(tmp_path):
    p = tmp_path / "bad.wav"
    p.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    with pytest.raises(UnsupportedMedia, match="bad.wav"):
        audio.load_wav(p)
    (tmp_path / "text.wav").write_text("hello")
    with pytest.raises(UnsupportedMedia):
        audio.load_wav(tmp_path / "text.wav")
    with pytest.raises(MetraleError, match="no such"):
        audio.load_wav(tmp_path / "missing.wav")


def test_load_wav_empty(tmp_path):
    write_wav(tmp_path / "e.wav", np.zeros(0), 16000)
    with pytest.raises(InvalidArgument, match="no audio"):
        audio.load_wav(tmp_path / "e.wav")


@pytest.mark.parametrize("rate", [44100, 22050, 8000, 192001])   # 192001: no phase table
def test_resample_is_the_windowed_sinc_formula(rate):
    """Every output is the Hann-windowed sinc sum at its exact input time n * rate / 16000,
    evaluated here one output at a time in float64."""
    import math
    from fractions import Fraction
    x = np.random.default_rng(rate).standard_normal(rate // 50)   # 20 ms
    got = audio.resample(x, rate, 16000)
    cutoff = 0.97 * min(1.0, 16000 / rate)
    half = math.ceil(32 / cutoff)
    for n in range(0, got.size, max(1, got.size // 40)):
        t = Fraction(n * rate, 16000)
        base = math.floor(t)
        want = 0.0
        for j in range(base - half + 1, base + half + 1):
            if 0 <= j < x.size:
                u = float(t - j)
                hann = 0.5 + 0.5 * math.cos(math.pi * min(max(u / half, -1), 1))
                want += x[j] * cutoff * np.sinc(cutoff * u) * hann
        assert abs(got[n] - want) <= 1e-6 * max(1.0, abs(want)), (n, got[n], want)
