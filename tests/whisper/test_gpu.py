"""WhisperModel on a device backend (emu or CUDA): the same goldens, and the kernels against
the HostBackend twins."""
import numpy as np
import pytest

from metrale import to_numpy

from metrale.engine.transcribe import transcribe
from tests.conftest import TOL
from tests.model.common import assert_matches_golden
from tests.whisper.common import golden, load, rel_err

pytestmark = pytest.mark.gpu


def test_gpu_encoder_and_logits_match_golden(device):
    g = golden()
    m = load(device)
    try:
        enc = m.encode_audio(g["mel"])
        enc_h = to_numpy(enc)
        assert rel_err(enc_h[0], g["encoder"]) < TOL["model_vs_golden_rel_max"][0]
        ids = g["decoder_input_ids"][0].tolist()
        for i in range(1, len(ids) + 1):
            got = to_numpy(m.decode_step(ids[:i], enc))
            assert_matches_golden(got, g["decoder_logits"][i - 1], f"prefix {i}")
    finally:
        m.close()


def test_gpu_cached_equals_uncached(device):
    g = golden()
    m = load(device)
    try:
        enc = m.encode_audio(g["mel"])
        ids = g["decoder_input_ids"][0].tolist()
        cached = [to_numpy(m.decode_step(ids[:i], enc)) for i in range(1, len(ids) + 1)]
        for i in range(1, len(ids) + 1):
            m.reset_cache()
            assert np.array_equal(to_numpy(m.decode_step(ids[:i], enc.copy())), cached[i - 1]), i
    finally:
        m.close()


def test_gpu_matches_host(device, host):
    g = golden()
    mc, mh = load(device), load(host)
    try:
        ec, eh = to_numpy(mc.encode_audio(g["mel"])), mh.encode_audio(g["mel"])
        assert rel_err(ec, eh) < 0.02
        ids = g["decoder_input_ids"][0].tolist()
        assert rel_err(to_numpy(mc.decode_step(ids, eh)), mh.decode_step(ids, eh)) < 0.02
        assert transcribe(mc, g["audio"], max_new_tokens=8).tokens == [39] * 8
    finally:
        mc.close()
        mh.close()
