"""WAV files as recorders and editors write them (issue 14 item 5): IEEE float 32/64-bit,
WAVE_FORMAT_EXTENSIBLE, 24-bit PCM, extra chunks with odd sizes, stereo at 44.1 kHz."""
import struct

import numpy as np
import pytest

from metrale import audio
from metrale.errors import UnsupportedMedia

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE


def riff(fmt: bytes, data: bytes, extra: bytes = b"") -> bytes:
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra + \
        b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def fmt_chunk(tag, channels, rate, bits, sub_tag=None):
    block = channels * bits // 8
    base = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if tag != EXTENSIBLE:
        return base
    guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    return base + struct.pack("<HHI", 22, bits, 3) + struct.pack("<H", sub_tag) + guid_tail


def write_float_wav(path, x, rate, bits=32, extensible=False):
    """x: float [n, channels]."""
    x = np.asarray(x, np.float64)
    data = x.astype("<f4" if bits == 32 else "<f8").tobytes()
    fmt = fmt_chunk(EXTENSIBLE, x.shape[1], rate, bits, FLOAT) if extensible else \
        fmt_chunk(FLOAT, x.shape[1], rate, bits)
    path.write_bytes(riff(fmt, data))


def tone(rate, seconds, channels):
    t = np.arange(int(rate * seconds)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * (300 + 200 * c) * t) for c in range(channels)],
                    axis=1)


@pytest.mark.parametrize("bits, extensible", [(32, False), (64, False), (32, True)])
def test_float_wav_reads_exactly(tmp_path, bits, extensible):
    x = tone(16000, 0.25, 1)
    write_float_wav(tmp_path / "f.wav", x, 16000, bits, extensible)
    samples, rate = audio.read_wav(tmp_path / "f.wav")
    assert rate == 16000 and samples.shape == (4000, 1)
    assert np.array_equal(samples[:, 0], x[:, 0].astype(np.float32))
    assert np.array_equal(audio.load_wav(tmp_path / "f.wav"), x[:, 0].astype(np.float32))


def test_stereo_float_at_44k1_is_downmixed_and_resampled(tmp_path):
    x = tone(44100, 0.5, 2)
    write_float_wav(tmp_path / "s.wav", x, 44100)
    got = audio.load_wav(tmp_path / "s.wav")
    want = audio.resample(x.mean(axis=1), 44100, 16000)
    assert got.shape == (8000,) and np.max(np.abs(got - want)) < 1e-6


def test_extensible_24_bit_pcm_and_odd_chunks(tmp_path):
    x = tone(16000, 0.1, 2)
    v = np.round(np.clip(x, -1, 1) * (2 ** 23 - 1)).astype(np.int64)
    b = v.reshape(-1)
    raw = np.stack([(b >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).tobytes()
    odd = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\x00"     # padded to an even size
    (tmp_path / "p.wav").write_bytes(riff(fmt_chunk(EXTENSIBLE, 2, 16000, 24, PCM), raw, odd))
    samples, rate = audio.read_wav(tmp_path / "p.wav")
    assert samples.shape == (1600, 2)
    assert np.max(np.abs(samples - x)) < 2 / 2 ** 23


def test_unsupported_encodings_name_the_file(tmp_path):
    (tmp_path / "adpcm.wav").write_bytes(riff(fmt_chunk(2, 1, 16000, 4), b"\x00" * 16))
    with pytest.raises(UnsupportedMedia, match="adpcm.wav.*format tag 0x0002"):
        audio.load_wav(tmp_path / "adpcm.wav")
    (tmp_path / "f16.wav").write_bytes(riff(fmt_chunk(FLOAT, 1, 16000, 16), b"\x00" * 16))
    with pytest.raises(UnsupportedMedia, match="16-bit IEEE float"):
        audio.load_wav(tmp_path / "f16.wav")
    (tmp_path / "nodata.wav").write_bytes(riff(fmt_chunk(PCM, 1, 16000, 16), b"")[:-8])
    with pytest.raises(UnsupportedMedia, match="no data chunk"):
        audio.load_wav(tmp_path / "nodata.wav")
