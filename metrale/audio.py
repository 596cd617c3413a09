"""The Whisper audio front end, numpy only: WAV reading, resampling and the log-mel
spectrogram of Hugging Face's `WhisperFeatureExtractor`.

    audio = load_wav("speech.wav")               # float32 mono at 16 kHz
    mel = log_mel_spectrogram(audio, n_mels=80)  # [80, 3000] float32

`log_mel_spectrogram` follows the extractor step by step: zero-pad (or cut) to 30 s, a
centred 400-point periodic-Hann STFT with hop 160 (reflect padding), the power spectrum,
Slaney-style mel filters (0 - 8 kHz, Slaney normalisation), log10 of max(mel, 1e-10), the
last frame dropped, a floor at max - 8, then (x + 4) / 4. FP64 inside, float32 out.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np

from .errors import InvalidArgument, UnsupportedMedia

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE   # 480000 samples in one 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH        # 3000 mel frames in one window


# --------------------------------------------------------------------------- checks
def check_audio(audio, what: str = "audio", sampling_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A 1-D finite float array at 16 kHz as float32, or InvalidArgument naming the fault."""
    if int(sampling_rate) != SAMPLE_RATE:
        raise InvalidArgument(f"{what}: sampling_rate is {sampling_rate} Hz; Whisper takes "
                              f"{SAMPLE_RATE} Hz audio (resample first: "
                              "metrale.audio.resample or load_wav(..., resample=True))")
    from .gpu_runtime.arrays import to_numpy
    x = to_numpy(audio)
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.ndim == 2 and 1 in x.shape and x.size > 1:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise InvalidArgument(f"{what}: expected mono audio, a 1-D array of samples; got "
                              f"shape {x.shape} (stereo/multi-channel: average the channels "
                              "first)")
    if x.size == 0:
        raise InvalidArgument(f"{what}: empty audio (0 samples)")
    if x.dtype.kind != "f":
        raise InvalidArgument(f"{what}: expected float samples in [-1, 1], got dtype {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(f"{what}: contains NaN or infinite samples")
    return x


# --------------------------------------------------------------------------- mel filters
def _hz_to_mel(f):
    f = np.asarray(f, np.float64)
    mel = 3.0 * f / 200.0
    logstep = 27.0 / math.log(6.4)
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) * logstep, mel)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    f = 200.0 * m / 3.0
    logstep = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), f)


@lru_cache(maxsize=8)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sampling_rate: int = SAMPLE_RATE,
                f_min: float = 0.0, f_max: float = 8000.0) -> np.ndarray:
    """Slaney mel filter bank `[1 + n_fft // 2, n_mels]` (float64, read-only), as
    transformers' `mel_filter_bank(..., norm="slaney", mel_scale="slaney")`."""
    fft_freqs = np.linspace(0.0, sampling_rate / 2, 1 + n_fft // 2)
    mels = np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), n_mels + 2)
    f = _mel_to_hz(mels)
    diff = np.diff(f)
    slopes = f[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))
    fb *= (2.0 / (f[2:n_mels + 2] - f[:n_mels]))[None, :]
    fb.setflags(write=False)
    return fb


# --------------------------------------------------------------------------- log-mel
def log_mel_spectrogram(audio, n_mels: int = 80, padding_to_30s: bool = True, *,
                        sampling_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Whisper log-mel features of 16 kHz float mono audio.

    With `padding_to_30s` (the extractor's default) the audio is zero-padded or cut to 30 s
    and the result is `[n_mels, 3000]`; otherwise it is `[n_mels, len(audio) // 160]`
    (audio of more than 200 samples). float32.
    """
    if isinstance(n_mels, bool) or not isinstance(n_mels, (int, np.integer)) or n_mels < 1:
        raise InvalidArgument(f"log_mel_spectrogram: n_mels must be an int >= 1, got {n_mels!r}")
    x = check_audio(audio, "log_mel_spectrogram: audio", sampling_rate).astype(np.float64)
    if padding_to_30s:
        buf = np.zeros(N_SAMPLES, np.float64)
        n = min(x.size, N_SAMPLES)
        buf[:n] = x[:n]
        x = buf
    elif x.size <= N_FFT // 2:
        raise InvalidArgument(f"log_mel_spectrogram: audio has {x.size} samples; without "
                              f"padding it needs more than {N_FFT // 2}")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    padded = np.pad(x, N_FFT // 2, mode="reflect")
    n_frames = 1 + (padded.size - N_FFT) // HOP_LENGTH
    idx = np.arange(N_FFT)[None, :] + HOP_LENGTH * np.arange(n_frames)[:, None]
    power = np.abs(np.fft.rfft(padded[idx] * window[None, :], n=N_FFT, axis=1)) ** 2
    mel = power @ mel_filters(int(n_mels))                       # [frames, n_mels]
    log_spec = np.log10(np.maximum(mel, 1e-10)).T[:, :-1]        # drop the last frame
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


# --------------------------------------------------------------------------- resampling
def resample(audio: np.ndarray, orig_rate: int, target_rate: int = SAMPLE_RATE,
             zero_crossings: int = 32) -> np.ndarray:
    """Band-limited resampling (Hann-windowed sinc, cutoff 0.97 x the lower Nyquist).

    `audio`: 1-D float; returns float32 of `ceil(len * target / orig)` samples."""
    orig_rate, target_rate = int(orig_rate), int(target_rate)
    if orig_rate < 1 or target_rate < 1:
        raise InvalidArgument(f"resample: rates must be >= 1 Hz, got {orig_rate} -> "
                              f"{target_rate}")
    x = np.asarray(audio, np.float64).reshape(-1)
    if orig_rate == target_rate:
        return x.astype(np.float32)
    cutoff = 0.97 * min(1.0, target_rate / orig_rate)  # in units of the input Nyquist
    half = int(math.ceil(zero_crossings / cutoff))      # half-width in input samples
    n_out = -(-x.size * target_rate // orig_rate)
    xp = np.concatenate([np.zeros(half), x, np.zeros(half + 1)])
    out = np.empty(n_out, np.float64)
    taps = np.arange(-half + 1, half + 1)

    def kernel(u):
        return cutoff * np.sinc(cutoff * u) * (0.5 + 0.5 * np.cos(np.pi * np.clip(u / half,
                                                                               -1, 1)))
    # Output n sits at input time n * down / up, at phase (n * down) % up of a sample: the
    # outputs n = r, r + up, r + 2 up, ... share one kernel row and their windows step by
    # `down` input samples. So when that table is small (44.1k -> 16k: 160 rows), each row
    # is one strided matrix-vector product instead of a sinc per tap and output (a 31 s
    # file: 0.25 s instead of 21 s), and exact phases avoid the rounding of n * ratio.
    # einsum, not `@`: BLAS threads on a gemv this thin thrash on a busy machine (10x).
    g = math.gcd(orig_rate, target_rate)
    up, down = target_rate // g, orig_rate // g
    if up * taps.size <= (1 << 22):
        table = kernel(np.arange(up)[:, None] / up - taps[None, :])   # [up, taps]
        for r in range(min(up, n_out)):
            m = -(-(n_out - r) // up)                    # outputs r, r + up, ... < n_out
            start = (r * down) // up + 1                 # xp index of tap -half+1 (+half)
            windows = np.lib.stride_tricks.as_strided(
                xp[start:], shape=(m, taps.size), strides=(down * xp.strides[0],
                                                           xp.strides[0]), writeable=False)
            out[r::up] = np.einsum("mk,k->m", windows, table[(r * down) % up])
        return out.astype(np.float32)
    step = max(1, (1 << 22) // taps.size)
    for s in range(0, n_out, step):
        n = np.arange(s, min(n_out, s + step))
        base = (n * down) // up                           # input sample at or before
        j = base[:, None] + taps[None, :]
        w = kernel((n * down - base * up)[:, None] / up - taps[None, :])
        out[s:s + n.size] = np.sum(xp[j + half] * w, axis=1)
    return out.astype(np.float32)


# --------------------------------------------------------------------------- WAV
# RIFF/WAVE format tags (the fmt chunk's first field; WAVE_FORMAT_EXTENSIBLE keeps the real
# one in the first two bytes of its SubFormat GUID)
WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
CONVERT_HINT = "convert it with e.g. ffmpeg -i IN -ac 1 -ar 16000 -c:a pcm_s16le OUT.wav"


def read_wav(path) -> tuple[np.ndarray, int]:
    """Samples `[frames, channels]` float32 in [-1, 1] and the sample rate of a WAV file.

    The RIFF chunks are parsed here (the standard library's `wave` reads integer PCM only):
    PCM 8-bit unsigned / 16 / 24 / 32-bit signed, IEEE float 32 / 64-bit, plain or
    WAVE_FORMAT_EXTENSIBLE. Anything else raises UnsupportedMedia naming the file.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise InvalidArgument(f"{p}: no such audio file")
    with open(p, "rb") as f:
        blob = f.read()
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise UnsupportedMedia(f"{p}: not a RIFF/WAVE file; {CONVERT_HINT}")
    fmt = data = None
    pos = 12
    while pos + 8 <= len(blob):
        cid, size = blob[pos:pos + 4], int.from_bytes(blob[pos + 4:pos + 8], "little")
        body = blob[pos + 8:pos + 8 + size]   # a streamed file's data may claim more
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            data = body
            if fmt is not None:
                break
        pos += 8 + size + (size & 1)           # chunks are padded to even sizes
    if fmt is None or len(fmt) < 16 or data is None:
        raise UnsupportedMedia(f"{p}: no {'fmt' if fmt is None or len(fmt) < 16 else 'data'}"
                               f" chunk; {CONVERT_HINT}")
    tag, channels, rate = (int.from_bytes(fmt[0:2], "little"),
                           int.from_bytes(fmt[2:4], "little"),
                           int.from_bytes(fmt[4:8], "little"))
    bits = int.from_bytes(fmt[14:16], "little")
    if tag == WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        tag = int.from_bytes(fmt[24:26], "little")
    if channels < 1 or rate < 1:
        raise UnsupportedMedia(f"{p}: fmt chunk says {channels} channels at {rate} Hz")
    width = (bits + 7) // 8
    if tag == WAVE_FORMAT_PCM and width in (1, 2, 3, 4):
        x = _pcm_to_float(data[: len(data) - len(data) % width], width)
    elif tag == WAVE_FORMAT_IEEE_FLOAT and width in (4, 8):
        x = np.frombuffer(data[: len(data) - len(data) % width],
                          "<f4" if width == 4 else "<f8").astype(np.float32)
    else:
        kind = {WAVE_FORMAT_PCM: "PCM", WAVE_FORMAT_IEEE_FLOAT: "IEEE float"}.get(
            tag, f"format tag 0x{tag:04x}")
        raise UnsupportedMedia(f"{p}: {bits}-bit {kind} samples are not supported (PCM "
                               f"8/16/24/32-bit and IEEE float 32/64-bit are); {CONVERT_HINT}")
    return x[: x.size - x.size % channels].reshape(-1, channels), rate


def load_wav(path, *, resample_to: int | None = SAMPLE_RATE, downmix: bool = True
             ) -> np.ndarray:
    """Read a WAV file (see `read_wav`) as float32 mono in [-1, 1].

    `resample_to`: resample to this rate (16 kHz by default); None keeps the file's rate
    only if it already is 16 kHz, else UnsupportedMedia. Multi-channel files are averaged
    to mono (`downmix=False` raises UnsupportedMedia instead).
    """
    p = os.fspath(path)
    x, rate = read_wav(p)
    channels = x.shape[1]
    if x.size == 0:
        raise InvalidArgument(f"{p}: the file holds no audio samples")
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(f"{p}: contains NaN or infinite samples")
    if channels > 1:
        if not downmix:
            raise UnsupportedMedia(f"{p}: {channels} channels and downmix=False; metrale "
                                   "transcribes mono audio")
        x = x.mean(axis=1, dtype=np.float64).astype(np.float32)
    else:
        x = x[:, 0]
    if rate != SAMPLE_RATE and resample_to is None:
        raise UnsupportedMedia(f"{p}: sample rate {rate} Hz; Whisper needs {SAMPLE_RATE} Hz "
                               "and resampling was turned off (resample_to=None)")
    if resample_to is not None and rate != int(resample_to):
        x = resample(x, rate, int(resample_to))
    return np.ascontiguousarray(x, np.float32)


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    if width == 1:  # unsigned 8-bit
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8)
        b = b[: b.size - b.size % 3].reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        return v.astype(np.float32) / float(1 << 23)
    return (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
