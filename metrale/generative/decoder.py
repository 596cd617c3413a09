"""`DecoderGenerativeModel`: the tensor contract over a `TransformerModel`.

Same kernels and buffers as the pointer API: `embed` gathers from the embedding table,
`prefill`/`prefill_hidden`/`prefill_all_logits` run the prefill pass on the given
embeddings, `decode`/`decode_all_logits` the decode pass (one row per position, so
`decode_all_logits` rows equal step-by-step `decode`).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..formats import open_source
from ..gpu_runtime import backend_for
from ..gpu_runtime.arrays import to_backend, to_numpy
from ..kv.config import CacheConfig
from ..model_engine import TransformerModel
from ..model_engine.layers import lm_head
from ..model_engine.linear import GgufLinear
from ..ops.bf16 import bf16_to_f32, f32_to_bf16
from .contract import GenerativeModel
from .kv_cache import KVCache


class DecoderGenerativeModel(GenerativeModel):
    def __init__(self, model) -> None:
        self.model = model
        self.backend = model.backend

    @classmethod
    def load(cls, source, device="auto", **options) -> "DecoderGenerativeModel":
        """A decoder-only checkpoint (llama, mistral, qwen2, qwen3) as a `TransformerModel`
        behind the contract; `options` are `TransformerModel`'s. `metrale.load_generative`
        picks the class for any architecture."""
        return cls(TransformerModel(backend_for(device), open_source(source), **options))

    def metadata(self):
        return self.model.metadata()

    def create_kv_cache(self, config: CacheConfig | None = None, batch: int = 1) -> KVCache:
        if config is None:
            config = CacheConfig(max_seq_len=self.model._max_seq_len,
                                 block_size=self.model.kv_block_size())
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1024:
            raise InvalidArgument(f"create_kv_cache: batch must be an int in [1, 1024], got {batch!r}")
        return KVCache(self.model, config, batch)

    def supports_decode_all_logits(self) -> bool:
        return True

    def supports_hidden_states(self) -> bool:
        return True

    # -------------------------------------------------------------------------- inputs
    def embed(self, tokens):
        ids = np.asarray(to_numpy(tokens))
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InvalidArgument(f"embed: tokens must be a [batch, seq] integer array, got "
                                  f"{ids.dtype} {ids.shape}")
        for row in ids:
            self.model._check_tokens(row, "embed")
        table = bf16_to_f32(self._embedding_rows(ids.reshape(-1)))
        scale = self.metadata().variant.embed_scale
        if scale:   # Gemma's normalizer, as the model's embedding pass applies it
            table = bf16_to_f32(f32_to_bf16(table * np.float32(scale)))
        return to_backend(self.backend, table.reshape(*ids.shape, -1))

    def _embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        """BF16 bits of the embedding rows of `ids` (copied from the device table)."""
        hid = self.metadata().hidden_size
        base = self.model._weights.embed_tokens
        if isinstance(base, GgufLinear):   # a GGUF table kept packed: rows dequantized
            return base.host_rows(self.backend, ids)
        out = np.empty((len(ids), hid), np.uint16)
        for i, t in enumerate(ids):
            self.backend.copy_d2h(base.offset(int(t) * hid * 2), out[i])
        return out

    def _input(self, x, cache: KVCache, what: str, pos: range | None):
        arr = np.asarray(to_numpy(x), dtype=np.float32)
        hid = self.metadata().hidden_size
        if arr.ndim != 3 or arr.shape[2] != hid or arr.shape[1] < 1:
            raise InvalidArgument(f"{what}: input must be [batch, seq, {hid}] float32, got "
                                  f"shape {arr.shape}")
        if not isinstance(cache, KVCache) or cache.model is not self.model or not cache.seqs:
            raise InvalidArgument(f"{what}: cache is not a live KVCache of this model")
        if arr.shape[0] != cache.batch:
            raise InvalidArgument(f"{what}: input batch {arr.shape[0]} != cache batch "
                                  f"{cache.batch}")
        if pos is not None:
            if not isinstance(pos, range) or pos.step != 1:
                raise InvalidArgument(f"{what}: pos must be a range with step 1, got {pos!r}")
            if pos.stop - pos.start != arr.shape[1]:
                raise InvalidArgument(f"{what}: pos {pos!r} covers {pos.stop - pos.start} "
                                      f"positions but the input has {arr.shape[1]}")
            if pos.start != cache.seq_len():
                raise InvalidArgument(f"{what}: pos.start {pos.start} != cache length "
                                      f"{cache.seq_len()}")
        cache.check_room(arr.shape[1])
        for s in cache.seqs:
            self.model._check_capacity(s, arr.shape[1])
        return f32_to_bf16(arr)

    # -------------------------------------------------------------------------- passes
    def _prefill(self, x, cache, pos, what, on_chunk):
        """Run the prefill pass over every batch row; `on_chunk(b, seq, n)` reads outputs."""
        bits = self._input(x, cache, what, pos)
        m = self.model
        stream = m.default_stream()
        with m._guard:
            for b, seq in enumerate(cache.seqs):
                if seq.seq_len == 0:   # the prompt decides a LongRoPE sequence's rotation
                    seq.rope_long = m._long_prompt(range(bits.shape[1]))
                start = 0
                while start < bits.shape[1]:
                    n = min(m._ws.max_tokens, bits.shape[1] - start)
                    on_chunk(b, seq, bits[b, start:start + n], stream)
                    start += n
            m.synchronize(stream)

    def prefill(self, input, cache: KVCache, pos: range):
        V = self.metadata().vocab_size
        out = np.zeros((cache.batch, V), np.float32)

        def chunk(b, seq, emb, stream):
            last = seq.seq_len + len(emb) == pos.stop
            p = self.model._prefill_pass(seq, [-1] * len(emb), stream, want_logits=last,
                                         embeds=emb)
            if last:
                out[b] = self._read_logits(p, 1)[0]
        self._prefill(input, cache, pos, "prefill", chunk)
        return to_backend(self.backend, out)

    def prefill_hidden(self, input, cache: KVCache, pos: range):
        hid = self.metadata().hidden_size
        rows = []

        def chunk(b, seq, emb, stream):
            m = self.model
            m._prefill_pass(seq, [-1] * len(emb), stream, want_logits=False, embeds=emb)
            h = np.empty((len(emb), hid), np.uint16)
            m.backend.synchronize(stream)
            m.backend.copy_d2h(m._ws.normed, h)
            rows.append(bf16_to_f32(h))
        self._prefill(input, cache, pos, "prefill_hidden", chunk)
        return to_backend(self.backend, np.concatenate(rows)[None] if cache.batch == 1
                          else np.stack(np.split(np.concatenate(rows), cache.batch)))

    def prefill_all_logits(self, input, cache: KVCache, pos: range):
        V = self.metadata().vocab_size
        rows = []

        def chunk(b, seq, emb, stream):
            m, ws = self.model, self.model._ws
            n = len(emb)
            m._prefill_pass(seq, [-1] * n, stream, want_logits=False, embeds=emb)
            hid = self.metadata().hidden_size
            for r0 in range(0, n, ws.logits_rows):
                k = min(ws.logits_rows, n - r0)
                lm_head(m, stream, ws.normed.offset(r0 * hid * 2), k, ws.logits)
                rows.append(self._read_logits(ws.logits, k))
        self._prefill(input, cache, pos, "prefill_all_logits", chunk)
        all_rows = np.concatenate(rows).reshape(cache.batch, -1, V)
        return to_backend(self.backend, all_rows)

    def decode(self, input, cache: KVCache):
        bits = self._input(input, cache, "decode", None)
        if bits.shape[1] != 1:
            raise InvalidArgument(f"decode: input must hold one position, got {bits.shape[1]}")
        m = self.model
        with m._guard:
            p = m._decode_rows([(s, [-1]) for s in cache.seqs], m.default_stream(), "decode",
                               embeds=bits[:, 0])
            out = self._read_logits(p, cache.batch)
        return to_backend(self.backend, out)

    def decode_all_logits(self, input, cache: KVCache):
        bits = self._input(input, cache, "decode_all_logits", None)
        if cache.batch != 1:
            raise InvalidArgument("decode_all_logits: batch must be 1")
        m = self.model
        rows = []
        with m._guard:
            start, n = 0, bits.shape[1]
            while start < n:
                k = min(16, n - start)
                p = m._decode_rows([(cache.seqs[0], [-1] * k)], m.default_stream(),
                                   "decode_all_logits", embeds=bits[0, start:start + k])
                rows.append(self._read_logits(p, k))
                start += k
        return to_backend(self.backend, np.concatenate(rows)[None])

    def _read_logits(self, ptr, n: int) -> np.ndarray:
        """`n` logits rows at `ptr` as float32 (BF16 widened exactly)."""
        m = self.model
        V = self.metadata().vocab_size
        m.backend.synchronize(m.default_stream())
        if m.use_fp32_logits:
            out = np.empty((n, V), np.float32)
            m.backend.copy_d2h(ptr, out)
            return out
        bits = np.empty((n, V), np.uint16)
        m.backend.copy_d2h(ptr, bits)
        return bf16_to_f32(bits)
