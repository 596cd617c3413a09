"""Greedy speech-to-text over a `SpeechToTextModel` (Whisper).

    result = transcribe(model, audio)           # audio: float32 mono at 16 kHz (or a path)
    result.tokens, result.text, result.segments

The audio is cut into sequential 30 s windows (one segment each); every window is turned
into a log-mel spectrogram (metrale.audio), cropped to the frames the encoder takes,
encoded once, and decoded greedily from the standard prompt
    <|startoftranscript|> [<|lang|>] [<|task|>] [<|notimestamps|>]
whose ids come from the checkpoint's generation_config.json (decoder_start_token_id,
lang_to_id, task_to_id, no_timestamps_token_id; forced_decoder_ids fill the language when
none is given; otherwise the language is detected from the first step's logits). At every
step `suppress_tokens` are masked, at the first generated step `begin_suppress_tokens` too;
decoding stops at eos or after `max_new_tokens`.

With `timestamps=True` the prompt leaves out <|notimestamps|> and, after the suppression
masks, transformers' timestamp rules shape every step (WhisperTimeStampLogitsProcessor):
<|notimestamps|> is masked; timestamps come in pairs (after two timestamps text must
follow, after text + one timestamp another timestamp or eos); they never go backwards; the
first token is a timestamp no later than `max_initial_timestamp_index` (when
generation_config.json sets it); and when the timestamps' total probability beats every
text token a timestamp is forced. Each timestamp pair becomes a `Segment` (0.02 s steps,
plus the window's offset). Checkpoints whose vocabulary ends at <|notimestamps|> have no
timestamp tokens and refuse.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..audio import N_FRAMES, N_SAMPLES, SAMPLE_RATE, check_audio, load_wav, log_mel_spectrogram
from ..errors import InvalidArgument
from ..gpu_runtime.arrays import to_numpy

TASKS = ("transcribe", "translate")
TIME_PRECISION = 0.02   # seconds per timestamp token (30 s / 1500 encoder positions)


@dataclass
class Segment:
    """One 30 s window: its time span in seconds, generated tokens and text."""

    start: float
    end: float
    tokens: list[int]
    text: str | None = None


@dataclass
class Transcription:
    tokens: list[int]                   # generated ids of every window (no prompt, no eos)
    text: str | None = None             # decoded when a tokenizer was given
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None         # the language token used, e.g. "<|en|>"


def transcribe(model, audio, tokenizer=None, language: str | None = None,
               task: str = "transcribe", max_new_tokens: int = 224, *,
               timestamps: bool = False,
               sampling_rate: int = SAMPLE_RATE, on_window=None,
               on_step=None) -> Transcription:
    """Transcribe (or translate) `audio` — a float numpy array of 16 kHz mono samples, or a
    path to a WAV file (multi-channel files are averaged) — with greedy decoding.
    `tokenizer`: anything with `decode(ids, skip_special_tokens=True)`; `language`: "en" or
    "<|en|>" (None: forced by the checkpoint or detected); `task`: "transcribe" or
    "translate" (to English); `timestamps`: segment times from the model's timestamp
    tokens (`result.segments`), which then stay out of `result.tokens`. `on_window(i, n,
    segments)` is called after each 30 s window (i from 0 of n) with its segments, and
    `on_step(i, n, tokens)` within window i, after its encoder pass (tokens 0) and after
    each token decoded (a window decodes for tens of seconds on a CPU)."""
    w = model.metadata().whisper
    if w is None:
        raise InvalidArgument("transcribe: the model is not a Whisper (speech-to-text) model")
    if isinstance(audio, (str, os.PathLike)):
        audio = load_wav(audio)
    x = check_audio(audio, "transcribe: audio", sampling_rate)
    if task not in TASKS:
        raise InvalidArgument(f"transcribe: task must be one of {TASKS}, got {task!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise InvalidArgument(f"transcribe: max_new_tokens must be an int >= 1, got "
                              f"{max_new_tokens!r}")
    lang_token = _language_token(w, language)
    task_token = _task_token(w, task)
    V = model.metadata().vocab_size
    rules = _timestamp_rules(model.metadata(), V) if timestamps else None
    eos = set(model.metadata().eos_token_ids)
    suppress = np.array([t for t in w.suppress_tokens if 0 <= t < V], np.int64)
    begin = np.array([t for t in w.begin_suppress_tokens if 0 <= t < V], np.int64)
    frames = min(w.num_mel_frames, N_FRAMES)  # the frames the encoder takes

    result = Transcription(tokens=[])
    n_windows = max(1, -(-x.size // N_SAMPLES))
    for wi in range(n_windows):
        chunk = x[wi * N_SAMPLES:(wi + 1) * N_SAMPLES]
        mel = log_mel_spectrogram(chunk, n_mels=model.n_mels(), padding_to_30s=True)
        encoded = model.encode_audio(np.ascontiguousarray(mel[None, :, :frames]))
        step = None if on_step is None else \
            (lambda n_tokens, wi=wi: on_step(wi, n_windows, n_tokens))
        if step is not None:
            step(0)
        prompt = [w.decoder_start_token_id]
        lang = lang_token
        if lang is None and w.lang_to_id:
            lang = _detect_language(model, prompt, encoded, w)
        if lang is not None:
            prompt.append(w.lang_to_id[lang])
            result.language = result.language or lang
        if task_token is not None:
            prompt.append(task_token)
        nots = w.no_timestamps_token_id
        if nots is None:
            nots = dict(w.forced_decoder_ids).get(len(prompt))
        if nots is not None and rules is None:
            prompt.append(int(nots))
        out = _greedy(model, prompt, encoded, eos, suppress, begin,
                      min(int(max_new_tokens), w.max_target_positions - len(prompt)), rules,
                      step)
        start = wi * N_SAMPLES / SAMPLE_RATE
        end = min(x.size, (wi + 1) * N_SAMPLES) / SAMPLE_RATE
        segs = [Segment(start, end, out)] if rules is None else \
            _timestamp_segments(out, rules[0], start, end)
        for seg in segs:
            if tokenizer is not None:
                seg.text = _decode(tokenizer, seg.tokens)
            result.segments.append(seg)
            result.tokens.extend(seg.tokens)
        if on_window is not None:
            on_window(wi, n_windows, segs)
    if tokenizer is not None:
        result.text = _decode(tokenizer, result.tokens)
    return result


def _greedy(model, prompt, encoded, eos, suppress, begin, budget: int,
            rules=None, on_token=None) -> list[int]:
    tokens, out = list(prompt), []
    for step in range(max(0, budget)):
        logits = np.array(to_numpy(model.decode_step(tokens, encoded)), np.float32)
        if suppress.size:
            logits[suppress] = -np.inf
        if step == 0 and begin.size:
            logits[begin] = -np.inf
        if rules is not None:
            _apply_timestamp_rules(logits, out, *rules)
        nxt = int(np.argmax(logits))
        if nxt in eos:
            break
        tokens.append(nxt)
        out.append(nxt)
        if on_token is not None:
            on_token(len(out))
    return out


def _timestamp_rules(meta, vocab: int):
    """(first timestamp id, <|notimestamps|> id, eos id, max initial index or None), or
    InvalidArgument when the checkpoint has no timestamp tokens."""
    w = meta.whisper
    nots = w.no_timestamps_token_id
    if nots is None or nots + 1 >= vocab:
        raise InvalidArgument(f"transcribe: timestamps need timestamp tokens after "
                              f"<|notimestamps|> (no_timestamps_token_id {nots}), and this "
                              f"checkpoint's vocabulary ends at {vocab - 1}: it cannot time "
                              "its output; transcribe without timestamps")
    gen = meta.generation_config or {}
    max_initial = gen.get("max_initial_timestamp_index")
    eos = meta.eos_token_ids[0] if meta.eos_token_ids else w.decoder_start_token_id
    return int(nots) + 1, int(nots), int(eos), (None if max_initial is None
                                                else int(max_initial))


def _apply_timestamp_rules(logits, out, ts_begin, nots, eos, max_initial) -> None:
    """Mask `logits` [vocab] in place by the timestamp rules, `out`: tokens generated so far
    in this window."""
    logits[nots] = -np.inf
    last_ts = len(out) >= 1 and out[-1] >= ts_begin
    penultimate_ts = len(out) < 2 or out[-2] >= ts_begin
    if last_ts:
        if penultimate_ts:
            logits[ts_begin:] = -np.inf   # a pair just closed (or opened the window): text
        else:
            logits[:eos] = -np.inf        # text then one timestamp: its pair, or eos
    stamps = [t for t in out if t >= ts_begin]
    if stamps:
        # never backwards; after a closed pair not the same time again
        floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
        logits[ts_begin:floor] = -np.inf
    if not out:
        logits[:ts_begin] = -np.inf
        if max_initial is not None:
            logits[ts_begin + max_initial + 1:] = -np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        x = logits.astype(np.float64)
        top = np.max(x)
        if not np.isfinite(top):
            return
        logp = x - (top + np.log(np.sum(np.exp(x - top))))
        ts_mass = np.logaddexp.reduce(logp[ts_begin:])
        if ts_mass > np.max(logp[:ts_begin]):
            logits[:ts_begin] = -np.inf


def _timestamp_segments(out, ts_begin, offset: float, window_end: float) -> list[Segment]:
    """Split one window's tokens at timestamp pairs: <|t0|> text <|t1|> -> Segment."""
    segs, start, text = [], None, []
    for t in out:
        if t >= ts_begin:
            when = offset + (t - ts_begin) * TIME_PRECISION
            if start is None:
                start = when
            else:
                if text:   # an empty pair times nothing
                    segs.append(Segment(start, when, text))
                start, text = None, []
        else:
            text.append(t)
    if text:   # the window ended (or the budget ran out) inside a segment
        segs.append(Segment(offset if start is None else start, window_end, text))
    return segs


def _detect_language(model, prompt, encoded, w) -> str:
    logits = np.asarray(to_numpy(model.decode_step(prompt, encoded)), np.float32)
    names = list(w.lang_to_id)
    ids = np.array([w.lang_to_id[n] for n in names], np.int64)
    return names[int(np.argmax(logits[ids]))]


def _language_token(w, language) -> str | None:
    if language is None:
        forced = dict(w.forced_decoder_ids).get(1)
        by_id = {v: k for k, v in w.lang_to_id.items()}
        return by_id.get(forced) if forced is not None else None
    if not isinstance(language, str):
        raise InvalidArgument(f"transcribe: language must be a str like 'en', got {language!r}")
    if not w.lang_to_id:
        raise InvalidArgument(f"transcribe: language {language!r} given but this checkpoint "
                              "has no language tokens (lang_to_id in generation_config.json)")
    tok = language if language.startswith("<|") else f"<|{language.lower()}|>"
    if tok not in w.lang_to_id:
        known = ", ".join(sorted(k.strip("<|>") for k in w.lang_to_id)[:20])
        raise InvalidArgument(f"transcribe: unknown language {language!r} (known: {known})")
    return tok


def _task_token(w, task: str) -> int | None:
    if w.task_to_id:
        if task not in w.task_to_id:
            raise InvalidArgument(f"transcribe: task {task!r} has no token in this checkpoint "
                                  f"(task_to_id: {sorted(w.task_to_id)})")
        return int(w.task_to_id[task])
    if task != "transcribe":
        raise InvalidArgument(f"transcribe: task {task!r} needs task tokens; this checkpoint "
                              "has none (English-only model)")
    return None


def _decode(tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(ids)
