"""`WhisperModel`: the `SpeechToTextModel` contract for Whisper checkpoints.

    model = metrale.load("whisper-small/")            # or metrale.load_generative(...)
    enc = model.encode_audio(mel)                      # [1, n_mels, F] -> [1, T, d] float32
    logits = model.decode_step([sot, lang, task, nots], enc)   # [vocab] float32

Arrays are the backend's (numpy on CPU, CuPy on CUDA). The decoder keeps, per encoded
window (a small LRU keyed by the identity of the `encoded` array, which the entry keeps
alive), the cross-attention K/V of every layer (computed once) and a self-attention KV
buffer: a `decode_step` whose tokens extend (or share a prefix with) the previous call's
tokens for the same `encoded` runs only the new rows. Kernels and reductions are
row-invariant, so the cached step is bit-identical to recomputing the prefix.
Every argument check happens before the first launch.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..gpu_runtime.arrays import to_backend, to_numpy
from ..generative.contract import SpeechToTextModel
from ..gpu_runtime.types import DevicePtr
from ..model_engine.guard import CallGuard, exclusive
from ..ops.bf16 import bf16_to_f32
from .passes import GELU_MODES, Workspace, cross_kv, run_decoder, run_encoder, upload_rows
from .weights import WhisperWeights

_INT_TYPES = (int, np.integer)


class _Window:
    """Decoder state of one encoded window."""

    def __init__(self, encoded, n_enc: int, cross: DevicePtr, self_kv: DevicePtr) -> None:
        self.encoded = encoded     # keeps the array alive so its id() cannot be reused
        self.n_enc = n_enc
        self.cross_kv = cross      # [layers, n_enc, 2d] bf16
        self.self_kv = self_kv     # [layers, max_target_positions, 2d] bf16
        self.tokens: list[int] = []  # rows already in self_kv


class WhisperModel(SpeechToTextModel):
    """Whisper (encoder-decoder) on a `GpuBackend`. `window_cache`: how many encoded
    windows keep their decoder state (cross K/V + self KV) at once."""

    def __init__(self, backend, source, *, progress: bool = True, window_cache: int = 2,
                 **options) -> None:
        meta = source.metadata()
        if meta.architecture != "whisper" or meta.whisper is None:
            raise Unsupported(f"{source.description}: model_type {meta.architecture!r} is not "
                              "whisper")
        unknown = set(options) - {"kv_blocks", "block_size", "max_batch", "fp32_logits"}
        if unknown:
            raise InvalidArgument(f"WhisperModel: unknown option(s) {sorted(unknown)}")
        if not isinstance(window_cache, int) or window_cache < 1:
            raise InvalidArgument(f"WhisperModel: window_cache must be an int >= 1, got "
                                  f"{window_cache!r}")
        w = meta.whisper
        if w.activation_function not in GELU_MODES:
            raise Unsupported(f"{source.description}: activation_function "
                              f"{w.activation_function!r} is not supported "
                              f"(supported: {', '.join(GELU_MODES)})")
        if w.d_model % w.encoder_attention_heads or w.d_model % w.decoder_attention_heads:
            raise Unsupported(f"{source.description}: d_model {w.d_model} must be a multiple "
                              "of the attention heads")
        self.backend = backend
        self._meta, self._w = meta, w
        self._gelu = GELU_MODES[w.activation_function]
        self._guard = CallGuard()
        self._max_windows = window_cache
        self._windows: OrderedDict[int, _Window] = OrderedDict()
        self._weights = self._ws = None
        self.source_description = source.description
        try:
            self._weights = WhisperWeights(backend, source, meta, progress=progress)
            self._n_mels = self._weights.n_mels
            self._ws = Workspace(backend, w, self._n_mels, meta.vocab_size)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ contract
    def metadata(self):
        return self._meta

    def n_mels(self) -> int:
        return self._n_mels

    def vocab_size(self) -> int:
        return self._meta.vocab_size

    def max_frames(self) -> int:
        """Mel frames one window may have (2 x max_source_positions)."""
        return self._w.num_mel_frames

    def max_target_positions(self) -> int:
        return self._w.max_target_positions

    @exclusive
    def encode_audio(self, mel):
        """`[1, n_mels, frames]` log-mel -> `[1, (frames + 1) // 2, d_model]` float32
        (frames even: frames / 2), frames in [1, 2 * max_source_positions]."""
        x = self._check_mel(mel)
        b, s = self.backend, self.backend.default_stream()
        frames = x.shape[1]
        upload_rows(b, s, x.T, self._ws.mel)
        T = run_encoder(self, s, frames)
        out = np.empty((T, self._w.d_model), np.uint16)
        b.synchronize(s)
        b.copy_d2h(self._ws.en, out)
        return to_backend(b, bf16_to_f32(out)[None])

    @exclusive
    def decode_step(self, tokens: Sequence[int], encoded):
        """Logits `[vocab]` (float32) of the last position of `tokens` given `encoded`
        (`[1, T, d_model]` from `encode_audio`). Reuses the cached rows of the longest
        common prefix with the previous call for the same `encoded` array."""
        toks = self._check_tokens(tokens)
        win = self._window_for(encoded)
        start = 0
        for a, c in zip(win.tokens, toks):
            if a != c:
                break
            start += 1
        start = min(start, len(toks) - 1)
        n = len(toks) - start
        b, s, ws = self.backend, self.backend.default_stream(), self._ws
        win.tokens = win.tokens[:start]  # rows past start are about to be overwritten
        b.copy_h2d(np.asarray(toks[start:], np.int32), ws.tok)
        b.copy_h2d(np.arange(start, start + n, dtype=np.int32), ws.pos)
        run_decoder(self, s, start, n, win)
        win.tokens = list(toks)
        out = np.empty(self._meta.vocab_size, np.float32)
        b.synchronize(s)
        b.copy_d2h(ws.logits, out)
        return to_backend(b, out)

    # ------------------------------------------------------------------ cache
    @exclusive
    def reset_cache(self) -> None:
        """Forget every encoded window's decoder state (and free it)."""
        while self._windows:
            self._free_window(self._windows.popitem(last=False)[1])

    def cached_windows(self) -> int:
        return len(self._windows)

    def _window_for(self, encoded) -> _Window:
        key = id(encoded)
        win = self._windows.get(key)
        if win is not None and win.encoded is encoded:
            self._windows.move_to_end(key)
            return win
        host = self._check_encoded(encoded)
        while len(self._windows) >= self._max_windows:
            self._free_window(self._windows.popitem(last=False)[1])
        w, b = self._w, self.backend
        n_enc, d = host.shape[1], w.d_model
        layers = w.decoder_layers
        cross = b.alloc(layers * n_enc * 2 * d * 2)
        try:
            self_kv = b.alloc(layers * w.max_target_positions * 2 * d * 2)
        except BaseException:
            b.free(cross)
            raise
        win = _Window(encoded, n_enc, cross, self_kv)
        try:
            upload_rows(b, b.default_stream(), host[0], self._ws.enc_in)
            cross_kv(self, b.default_stream(), n_enc, cross)
        except BaseException:
            self._free_window(win)
            raise
        self._windows[key] = win
        return win

    def _free_window(self, win: _Window) -> None:
        self.backend.synchronize(self.backend.default_stream())
        for p in (win.cross_kv, win.self_kv):
            self.backend.free(p)
        win.encoded = None

    # ------------------------------------------------------------------ checks
    def _check_mel(self, mel) -> np.ndarray:
        x = to_numpy(mel)
        if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[0] != 1:
            raise InvalidArgument(f"encode_audio: mel must be [1, n_mels, frames], got shape "
                                  f"{getattr(x, 'shape', None)}")
        if x.shape[1] != self._n_mels:
            raise InvalidArgument(f"encode_audio: mel has {x.shape[1]} bins but this model's "
                                  f"n_mels is {self._n_mels}")
        frames, limit = x.shape[2], self.max_frames()
        if not 1 <= frames <= limit:
            raise InvalidArgument(f"encode_audio: mel has {frames} frames; must be in "
                                  f"[1, {limit}] (2 x max_source_positions "
                                  f"{self._w.max_source_positions})")
        x = np.asarray(x[0], np.float32)
        if not np.all(np.isfinite(x)):
            raise InvalidArgument("encode_audio: mel contains NaN or infinite values")
        return x

    def _check_encoded(self, encoded) -> np.ndarray:
        x = to_numpy(encoded)
        d, limit = self._w.d_model, self._w.max_source_positions
        if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[0] != 1 \
                or x.shape[2] != d or not 1 <= x.shape[1] <= limit:
            raise InvalidArgument(f"decode_step: encoded must be [1, T, {d}] with T in "
                                  f"[1, {limit}] (max_source_positions), got shape "
                                  f"{getattr(x, 'shape', None)}")
        x = np.asarray(x, np.float32)
        if not np.all(np.isfinite(x)):
            raise InvalidArgument("decode_step: encoded contains NaN or infinite values")
        return x

    def _check_tokens(self, tokens) -> list[int]:
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise InvalidArgument(f"decode_step: tokens must be a 1-D integer array, got "
                                      f"{tokens.dtype} with shape {tokens.shape}")
            tokens = tokens.tolist()
        try:
            toks = list(tokens)
        except TypeError:
            raise InvalidArgument(f"decode_step: tokens must be a sequence of ints, got "
                                  f"{type(tokens).__name__}") from None
        limit, V = self._w.max_target_positions, self._meta.vocab_size
        if not 1 <= len(toks) <= limit:
            raise InvalidArgument(f"decode_step: {len(toks)} tokens; must be in [1, {limit}] "
                                  "(max_target_positions)")
        for i, t in enumerate(toks):
            if isinstance(t, bool) or not isinstance(t, _INT_TYPES):
                raise InvalidArgument(f"decode_step: token {i} is {type(t).__name__}, not an "
                                      "int")
            if not 0 <= t < V:
                raise InvalidArgument(f"decode_step: token id {t} at index {i} is outside "
                                      f"[0, vocab_size={V})")
        return [int(t) for t in toks]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free every device buffer of this model (weights, workspace, cached windows)."""
        while self._windows:
            self._free_window(self._windows.popitem(last=False)[1])
        if self._ws is not None:
            self._ws.free()
            self._ws = None
        if self._weights is not None:
            self._weights.free()
            self._weights = None

    teardown = close
