"""Phi-3's LongRoPE against transformers (formats/phi3_config.py has the rule): a sequence
whose prompt fits original_max_position_embeddings (16 here) rotates with the short factors
and its decode steps switch to the long ones at position 16, as one transformers generate
call does (the golden `stepped_logits`: a 10-token prompt in one call, then one token a call
through HF's cache); a longer prompt rotates every position with the long factors (the
one-call golden `logits`), however it is chunked. The prefix cache never mixes the two;
batches and verify rows do not change a row's bits. Each piece, ignored, fails a golden."""
import numpy as np
import pytest

import metrale
from metrale import CacheConfig
from metrale.errors import FormatError, Unsupported
from metrale.formats.metadata import ModelMetadata
from metrale.generative import to_numpy
from metrale.gpu_runtime import HostBackend, backend
from metrale.ops import rope
from tests.conftest import emu_available
from tests.model.common import (FIXTURES, assert_matches_golden, golden, load, logits_rows,
                                rel_err)

NAME = "phi3_longrope"
BACKENDS = ["cpu", pytest.param("emu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not emu_available(), reason="no C++ compiler")])]


def teacher_forced(m, ids, prefix):
    s = m.default_stream()
    seq = m.alloc_sequence()
    rows = [logits_rows(m, m.prefill(ids[:prefix], seq, s))[0]]
    rows += [logits_rows(m, m.decode(t, seq, s))[0] for t in ids[prefix:]]
    return np.stack(rows), seq


@pytest.fixture(params=BACKENDS)
def device_name(request):
    return request.param


@pytest.fixture
def model(device_name):
    return load(NAME, backend(device_name))


def test_short_prompt_switches_at_the_original_context_during_decode(model):
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    rows, seq = teacher_forced(model, ids, int(g["stepped_prefix"]))
    assert not seq.rope_long
    assert_matches_golden(rows, g["stepped_logits"], "short prompt, decode across 16")
    # a one-call golden would have rotated the prompt with the long factors: far off
    assert rel_err(rows, g["logits"][9:]) > 0.06


@pytest.mark.parametrize("prefix", [17, 20, 24])
def test_long_prompt_rotates_every_position_long(model, prefix):
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    rows, seq = teacher_forced(model, ids, prefix)
    assert seq.rope_long
    assert_matches_golden(rows, g["logits"][prefix - 1:], f"{prefix}-token prompt")


def test_chunked_long_prompt_equals_whole_bits():
    m = load(NAME)
    ids = golden(NAME)["input_ids"][0].tolist()
    s = m.default_stream()
    want = logits_rows(m, m.prefill(ids[:20], m.alloc_sequence(), s))
    for bounds in ((0, 5, 12, 20), (0, 1, 16, 20)):   # the first chunks stay below 16
        seq = m.alloc_sequence()
        for a, b in zip(bounds[:-1], bounds[1:]):
            p = m.prefill_chunk(ids[:20], seq, a, b - a, b == 20, s)
        assert seq.rope_long and np.array_equal(logits_rows(m, p), want), bounds


def test_prefix_cache_keeps_short_and_long_sequences_apart():
    """A short prompt's cached block holds keys rotated with the short factors; a long prompt
    with the same first block must not reuse it (nor the reverse); long ones share."""
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    m = load(NAME, block_size=8)
    s = m.default_stream()
    short = m.alloc_sequence()
    m.prefill(ids[:16], short, s)                       # caches blocks 0-1 (short)
    long = m.alloc_sequence()
    got = logits_rows(m, m.prefill(ids, long, s))
    assert long.block_table[0] not in short.block_table   # not reused
    assert_matches_golden(got, g["logits"][-1], "long prompt after a short one")
    again = m.alloc_sequence()
    assert m.reuse_prefix(again, ids) == 16               # long prompts share
    m.free_sequence(again)
    short2 = m.alloc_sequence()
    assert m.reuse_prefix(short2, ids[:12]) == 8          # the short one's block 0
    assert short2.block_table[0] == short.block_table[0] and not short2.rope_long


def test_batch_and_verify_rows_keep_their_bits():
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    m = load(NAME)
    s = m.default_stream()
    seqs = []
    for n in (20, 12, 15):            # long, short, short crossing 16 in the batch
        seq = m.alloc_sequence()
        m.prefill(ids[:n], seq, s)
        seqs.append(seq)
    batch = logits_rows(m, m.decode_batch([ids[20], ids[12], ids[15]], seqs, s), 3)
    for i, n in enumerate((20, 12, 15)):
        solo, _ = teacher_forced(m, ids[:n + 1], n)
        assert np.array_equal(batch[i], solo[-1]), i
    seq = m.alloc_sequence()
    m.prefill(ids[:12], seq, s)
    m.decode_verify(ids[12:20], seq, s)                    # rows across position 16
    rows = logits_rows(m, m.logits_buffer_ptr(), 8)
    want, _ = teacher_forced(m, ids[:20], 12)
    assert np.array_equal(rows, want[1:])


def test_tensor_api_long_and_short_prompts():
    g = golden(NAME)
    ids = g["input_ids"]
    gm = metrale.load_generative(FIXTURES / NAME, HostBackend(), progress=False)
    with gm.create_kv_cache(CacheConfig(max_seq_len=32)) as cache:
        rows = [to_numpy(gm.prefill(gm.embed(ids[:, :10]), cache, range(0, 10)))[0]]
        rows += [to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0]
                 for t in range(10, 24)]
    assert_matches_golden(np.stack(rows), g["stepped_logits"], "tensor api, short prompt")
    with gm.create_kv_cache(CacheConfig(kind="contiguous", max_seq_len=32)) as cache:
        last = to_numpy(gm.prefill(gm.embed(ids), cache, range(0, 24)))
    assert_matches_golden(last, g["logits"][-1], "tensor api, long prompt")


def _static_table(m, which):
    """Every row of the model's table rotated with one set of factors (or without the
    attention factor): what a model ignoring the switch / the factor would compute."""
    meta = m.metadata()
    rs = meta.rope_scaling
    from dataclasses import replace
    if which == "no attention factor":
        rs = replace(rs, attention_factor=1.0)
    elif which == "short everywhere":
        rs = replace(rs, long_factor=rs.short_factor)
    table = rope.rope_table(meta.variant.rotary_dim, m._max_positions, meta.rope_theta, rs)
    m.backend.copy_h2d(table, m._layer_rope[0])


@pytest.mark.parametrize("which", ["short everywhere", "no attention factor",
                                   "whole head rotated", "per-position rule only"])
def test_each_piece_ignored_fails_a_golden(which):
    g = golden(NAME)
    ids = g["input_ids"][0].tolist()
    m = load(NAME)
    if which == "whole head rotated":
        from dataclasses import replace
        m._meta = m._layer_meta = replace(m._meta, variant=replace(m._meta.variant,
                                                                   rotary_dim=0))
        rs = m._meta.rope_scaling
        rd = m._meta.head_dim
        short = rs.short_factor + (1.0,) * ((rd - 2 * len(rs.short_factor)) // 2)
        long = rs.long_factor + (1.0,) * ((rd - 2 * len(rs.long_factor)) // 2)
        table = rope.rope_table(rd, m._max_positions, m._meta.rope_theta,
                                replace(rs, short_factor=short, long_factor=long))
        m._layer_rope = [m.backend.alloc(table.nbytes)] * m._meta.num_layers
        m.backend.copy_h2d(table, m._layer_rope[0])
    elif which == "per-position rule only":
        m._long_prompt = lambda tokens: False
    else:
        _static_table(m, which)
    stepped, _ = teacher_forced(m, ids, 10)
    long, _ = teacher_forced(m, ids, 20)
    err = max(rel_err(stepped, g["stepped_logits"]), rel_err(long, g["logits"][19:]))
    assert err > 0.06, f"ignoring {which} moves the logits by only {err:.3f}"


@pytest.mark.parametrize("changes,err,match", [
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 5,
                           "long_factor": [1.0] * 6}), FormatError, "short_factor"),
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 6,
                           "long_factor": [1.0] * 5 + [0.0]}), FormatError, "long_factor"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), Unsupported, "linear"),
    (dict(partial_rotary_factor=0.1, rope_parameters=None), Unsupported,
     "partial_rotary_factor"),
    (dict(original_max_position_embeddings=0), FormatError,
     "original_max_position_embeddings"),
    (dict(quantization_config={"quant_method": "gptq"}), Unsupported, "quantization_config"),
])
def test_bad_configs_are_refused_by_name(changes, err, match):
    import json
    cfg = json.loads((FIXTURES / NAME / "config.json").read_text())
    cfg.update(changes)
    with pytest.raises(err, match=match):
        ModelMetadata.from_config(cfg, source="config.json")


def test_older_rope_type_names_are_longrope():
    """Phi3Config maps `su` and `yarn` to longrope; top-level original_max_position_embeddings
    wins over the dict's."""
    import json
    cfg = json.loads((FIXTURES / NAME / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    for old in ("su", "yarn"):
        cfg["rope_scaling"] = {"type": old, "short_factor": rp["short_factor"],
                               "long_factor": rp["long_factor"],
                               "original_max_position_embeddings": 8}
        m = ModelMetadata.from_config(cfg)
        assert m.rope_scaling.rope_type == "longrope"
        assert m.rope_scaling.original_max_position_embeddings == 16
        assert abs(m.rope_scaling.attention_factor - (1 + np.log(4) / np.log(16)) ** 0.5) < 1e-12
