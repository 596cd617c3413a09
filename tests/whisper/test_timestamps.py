"""transcribe(timestamps=True): the prompt leaves out <|notimestamps|>, transformers'
timestamp rules shape every step, and timestamp pairs become segments (issue 14 item 5)."""
from dataclasses import replace

import numpy as np
import pytest

from metrale.engine.transcribe import _apply_timestamp_rules, transcribe
from metrale.errors import InvalidArgument
from tests.whisper.test_transcribe import EN, EOS, NOTS, SOT, TRANSCRIBE, FakeModel

TS = NOTS + 1          # <|0.00|>
VOCAB = TS + 100       # timestamps <|0.00|> .. <|1.98|>


def timed(script, max_initial=None):
    m = FakeModel(script)
    gen = {} if max_initial is None else {"max_initial_timestamp_index": max_initial}
    m.meta = replace(m.meta, vocab_size=VOCAB, generation_config=gen)
    return m


def wants(seq):
    """A script that prefers the tokens of `seq` in order (then eos), after the prompt."""
    def script(tokens):
        gen = tokens[3:]
        return {seq[len(gen)] if len(gen) < len(seq) else EOS: 30.0}
    return script


def test_pairs_become_segments_and_the_prompt_has_no_notimestamps():
    seq = [TS + 0, 10, 11, TS + 50, TS + 50, 12, TS + 80]
    m = timed(wants(seq))
    r = transcribe(m, np.zeros(32000, np.float32), timestamps=True)
    assert m.calls[0] == [SOT, EN, TRANSCRIBE]
    assert [(s.start, s.end, s.tokens) for s in r.segments] == \
        [(0.0, pytest.approx(1.0), [10, 11]), (pytest.approx(1.0), pytest.approx(1.6), [12])]
    assert r.tokens == [10, 11, 12]


def test_rules_force_a_first_timestamp_pairs_and_order():
    # the model always prefers text token 10, then a timestamp that goes backwards
    def script(tokens):
        return {10: 5.0, TS + 40: 4.0, TS + 3: 4.5, NOTS: 50.0}
    m = timed(script, max_initial=20)
    r = transcribe(m, np.zeros(16000, np.float32), timestamps=True, max_new_tokens=12)
    gen = m.calls[-1][3:] + [None]
    out = [t for t in gen if t is not None]
    assert NOTS not in out
    assert out[0] == TS + 3                     # forced timestamp, within the initial limit
    stamps = [t for t in out if t >= TS]
    assert stamps == sorted(stamps)
    assert r.segments and all(s.end >= s.start for s in r.segments)


def test_rule_masks_one_step_at_a_time():
    logits = np.zeros(VOCAB, np.float32)
    _apply_timestamp_rules(logits, [], TS, NOTS, EOS, 5)
    assert np.all(np.isinf(logits[:TS])) and np.all(np.isinf(logits[TS + 6:]))
    logits = np.zeros(VOCAB, np.float32)
    logits[11] = 10.0
    _apply_timestamp_rules(logits, [TS + 2, 10], TS, NOTS, EOS, None)   # text after a ts
    assert np.all(np.isinf(logits[TS:TS + 3])) and np.isfinite(logits[TS + 3])
    logits = np.zeros(VOCAB, np.float32)
    logits[EOS] = 10.0                 # (else the timestamps' total mass would mask it)
    _apply_timestamp_rules(logits, [TS + 2, 10, TS + 7], TS, NOTS, EOS, None)
    assert np.all(np.isinf(logits[:EOS])) and np.isfinite(logits[EOS])      # pair or eos
    assert np.all(np.isinf(logits[TS:TS + 7])) and np.isfinite(logits[TS + 7])
    logits = np.zeros(VOCAB, np.float32)
    logits[10] = 10.0
    _apply_timestamp_rules(logits, [TS + 2, 10, TS + 7, TS + 7], TS, NOTS, EOS, None)
    assert np.all(np.isinf(logits[TS:])) and np.isfinite(logits[10])      # then text


def test_timestamp_mass_beats_every_text_token():
    logits = np.full(VOCAB, -10.0, np.float32)
    logits[10] = 0.0
    logits[TS + 5:TS + 60] = -1.0            # 55 timestamps: more mass than token 10
    _apply_timestamp_rules(logits, [TS, 11], TS, NOTS, EOS, None)
    assert np.all(np.isinf(logits[:TS]))


def test_a_checkpoint_without_timestamp_tokens_refuses():
    m = FakeModel(wants([10]))                   # the fixture: vocab ends at <|notimestamps|>
    with pytest.raises(InvalidArgument, match="no_timestamps_token_id 255"):
        transcribe(m, np.zeros(16000, np.float32), timestamps=True)
