"""`TransformerModel`: the pointer API for decoder-only checkpoints (llama, mistral, qwen2,
qwen3), composed from the mixins exactly as the original engine's split supertraits.

Forward paths (all on `self._ws` buffers allocated at load):
  prefill / prefill_chunk — one sequence's chunk, cuBLAS GEMMs, causal paged attention;
      the last row's logits go to a staging row (`_ws.prefill_logits`).
  decode / decode_batch / decode_verify — one query row per (sequence, position), the
      batch-invariant GEMV and split-K decode attention; logits rows at
      `logits_buffer_ptr()`. With graphs on, replayed from CUDA graphs captured per padded
      batch size of the original ladder.
Every check (token ids, lengths, positions, pool capacity) happens before the first launch.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..gpu_runtime.types import NULL, DevicePtr
from ..kv.block_pool import BlockPool
from ..ops import argmax as argmax_ops
from ..ops import rope
from .args import bool_arg, int_arg, ptr_arg
from .forward import ModelForward
from .guard import CallGuard, exclusive
from .lifecycle import ModelLifecycle
from .logits import ModelLogits
from .passes import DecoderPasses
from .sequence import SequenceState
from .streams import ModelStreams
from .verify import ModelVerify
from .weights import DecoderWeights
from .workspace import Workspace

DECODER_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
MAX_VERIFY_ROWS = 16


class TransformerModel(ModelLogits, ModelForward, ModelLifecycle, ModelVerify, ModelStreams,
                       DecoderPasses):
    """A decoder-only model on a `GpuBackend`, driven through raw pointers."""

    def __init__(self, backend, source, *, kv_blocks: int | None = None, block_size: int = 16,
                 max_batch: int = 64, fp32_logits: bool = False,
                 max_prefill_tokens: int = 2048, max_seq_len: int | None = None,
                 graphs: bool | None = None, progress: bool = True) -> None:
        meta = source.metadata()
        if meta.architecture not in DECODER_ARCHITECTURES:
            raise Unsupported(f"{source.description}: model_type {meta.architecture!r} is not "
                              f"a decoder-only architecture ({', '.join(DECODER_ARCHITECTURES)})")
        _check_options(block_size, max_batch, max_prefill_tokens, kv_blocks, max_seq_len)
        self.backend = backend
        self._meta = meta
        self._guard = CallGuard()
        self.use_fp32_logits = bool(fp32_logits)
        self._block_size = block_size
        self._attn_scale = 1.0 / math.sqrt(meta.head_dim)
        max_rows = max(max_batch, MAX_VERIFY_ROWS)
        self._max_batch = max_batch
        self._weights = self._ws = None
        self._rope_table = NULL
        self._graphs: dict[int, int] = {}
        self._use_graphs = (backend.name.startswith("cuda")) if graphs is None else bool(graphs)
        from .memory_plan import plan_memory
        plan = plan_memory(backend, meta, kv_blocks=kv_blocks, block_size=block_size,
                           max_rows=max_rows, max_tokens=max_prefill_tokens,
                           max_seq_len=max_seq_len, fp32_logits=self.use_fp32_logits,
                           where=source.description)
        self._max_seq_len = plan.max_seq_len
        self._max_positions = plan.max_seq_len
        try:
            self._weights = DecoderWeights(backend, source, meta, progress=progress)
            self._ws = Workspace(backend, meta, max_tokens=max_prefill_tokens,
                                 max_rows=max_rows, num_blocks=plan.num_blocks,
                                 block_size=block_size,
                                 max_blocks_per_seq=plan.max_blocks_per_seq,
                                 fp32_logits=self.use_fp32_logits)
            table = rope.rope_table(meta.head_dim, self._max_positions, meta.rope_theta,
                                    meta.rope_scaling)
            self._rope_table = backend.alloc(table.nbytes)
            backend.copy_h2d(table, self._rope_table)
        except BaseException:
            self._release_device()
            raise
        self._pool = BlockPool(plan.num_blocks, block_size)
        self.source_description = source.description

    # ------------------------------------------------------------------ ModelLogits
    def metadata(self):
        return self._meta

    def vocab_size(self) -> int:
        return self._meta.vocab_size

    def logits_buffer_ptr(self) -> DevicePtr:
        return self._ws.logits

    def logits_ptr_is_fp32(self, logits_ptr: DevicePtr) -> bool:
        return self.use_fp32_logits and self._logits_region(logits_ptr) is not None

    def decode_logits_fp32(self) -> bool:
        return self.use_fp32_logits

    def decode_logits_ptr(self) -> DevicePtr:
        return self._ws.logits

    def hidden_after_norm(self) -> DevicePtr:
        return self._ws.final_hidden

    @exclusive
    def copy_logits_to_host(self, logits_ptr: DevicePtr, dst) -> None:
        row_bytes = self._meta.vocab_size * self._ws.logit_bytes
        nbytes = _nbytes_of(dst)
        if nbytes < row_bytes:
            raise InvalidArgument(f"copy_logits_to_host: dst holds {nbytes} bytes, one logits "
                                  f"row needs {row_bytes} (vocab {self._meta.vocab_size} x "
                                  f"{self._ws.logit_bytes})")
        rows = nbytes // row_bytes
        self._check_rows(logits_ptr, rows, "copy_logits_to_host")
        view = memoryview(dst).cast("B")[: rows * row_bytes] if not isinstance(dst, np.ndarray) \
            else dst.reshape(-1).view(np.uint8)[: rows * row_bytes]
        self.backend.synchronize(self.default_stream())
        self.backend.copy_d2h(logits_ptr, view)

    @exclusive
    def argmax_on_device(self, logits_ptr: DevicePtr, stream: int) -> int:
        return self._argmax(logits_ptr, 1, stream)[0]

    @exclusive
    def argmax_batch(self, logits_ptr: DevicePtr, n: int, stream: int) -> list[int]:
        n = int_arg("argmax_batch", "n", n, 1, self._ws.logits_rows)
        return self._argmax(logits_ptr, n, stream)

    def _argmax(self, logits_ptr, n: int, stream: int) -> list[int]:
        self._check_rows(logits_ptr, n, "argmax")
        V, ws, b = self._meta.vocab_size, self._ws, self.backend
        if self.use_fp32_logits:
            argmax_ops.argmax_fp32(b, stream, logits_ptr, ws.argmax_out, n, V)
        else:
            argmax_ops.argmax_bf16_batch(b, stream, logits_ptr, ws.argmax_out, n, V)
        out = np.empty(n, np.uint32)
        b.synchronize(stream)
        b.copy_d2h(ws.argmax_out, out)
        return [int(x) for x in out]

    def _logits_region(self, ptr) -> tuple[int, int] | None:
        ws, p = self._ws, int(ptr)
        row = self._meta.vocab_size * ws.logit_bytes
        for base, rows in ((ws.logits, ws.logits_rows), (ws.prefill_logits, 1)):
            if int(base) <= p < int(base) + rows * row:
                return int(base), int(base) + rows * row
        return None

    def _check_rows(self, ptr, rows: int, what: str) -> None:
        ptr = ptr_arg(what, "logits_ptr", ptr)
        region = self._logits_region(ptr)
        row = self._meta.vocab_size * self._ws.logit_bytes
        if region is None:
            raise InvalidArgument(f"{what}: {DevicePtr(int(ptr))!r} is not inside this model's "
                                  "logits buffers")
        if (int(ptr) - region[0]) % row or int(ptr) + rows * row > region[1]:
            raise InvalidArgument(f"{what}: {rows} row(s) at {DevicePtr(int(ptr))!r} run past "
                                  f"the logits buffer ({(region[1] - region[0]) // row} rows)")

    # ------------------------------------------------------------------ ModelForward
    def kv_block_size(self) -> int:
        return self._block_size

    @exclusive
    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> DevicePtr:
        tokens = self._check_tokens(tokens, "prefill")
        self._check_seq(seq)
        if seq.seq_len != 0:
            raise InvalidArgument(f"prefill: sequence {seq.seq_id} already holds {seq.seq_len} "
                                  "tokens; use prefill_chunk or decode to extend it")
        self._check_capacity(seq, len(tokens))
        start = self.reuse_prefix(seq, tokens)
        out = NULL
        T = self._ws.max_tokens
        while start < len(tokens):
            n = min(T, len(tokens) - start)
            out = self._prefill_pass(seq, tokens[start:start + n], stream,
                                     want_logits=start + n == len(tokens))
            start += n
        return out

    @exclusive
    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool, stream: int) -> DevicePtr:
        tokens = self._check_tokens(tokens, "prefill_chunk")
        self._check_seq(seq)
        chunk_start = int_arg("prefill_chunk", "chunk_start", chunk_start, 0)
        chunk_len = int_arg("prefill_chunk", "chunk_len", chunk_len)
        is_last_chunk = bool_arg("prefill_chunk", "is_last_chunk", is_last_chunk)
        if chunk_start != seq.seq_len:
            raise InvalidArgument(f"prefill_chunk: chunk_start {chunk_start} != seq_len "
                                  f"{seq.seq_len} of sequence {seq.seq_id}")
        if chunk_len < 1 or chunk_start + chunk_len > len(tokens):
            raise InvalidArgument(f"prefill_chunk: chunk [{chunk_start}, {chunk_start + chunk_len})"
                                  f" is empty or beyond the {len(tokens)}-token prompt")
        if is_last_chunk and chunk_start + chunk_len != len(tokens):
            raise InvalidArgument("prefill_chunk: is_last_chunk but the chunk does not end the "
                                  f"prompt ({chunk_start + chunk_len} of {len(tokens)})")
        self._check_capacity(seq, chunk_len)
        out = NULL
        start, end = chunk_start, chunk_start + chunk_len
        while start < end:
            n = min(self._ws.max_tokens, end - start)
            out = self._prefill_pass(seq, tokens[start:start + n], stream,
                                     want_logits=is_last_chunk and start + n == end)
            start += n
        return out if is_last_chunk else NULL

    @exclusive
    def decode(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        return self._decode_rows([(seq, [token])], stream, "decode")

    @exclusive
    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: int) -> DevicePtr:
        if len(tokens) != len(seqs):
            raise InvalidArgument(f"decode_batch: {len(tokens)} tokens for {len(seqs)} sequences")
        if not 1 <= len(seqs) <= self._max_batch:
            raise InvalidArgument(f"decode_batch: batch of {len(seqs)} outside [1, max_batch="
                                  f"{self._max_batch}]")
        if len({id(s) for s in seqs}) != len(seqs):
            raise InvalidArgument("decode_batch: a sequence appears twice in the batch")
        return self._decode_rows([(s, [t]) for s, t in zip(seqs, tokens)], stream,
                                 "decode_batch")

    # ------------------------------------------------------------------ ModelVerify
    @exclusive
    def decode_verify(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> list[int]:
        if not 1 <= len(tokens) <= MAX_VERIFY_ROWS:
            raise InvalidArgument(f"decode_verify: {len(tokens)} tokens outside [1, "
                                  f"{MAX_VERIFY_ROWS}]")
        ptr = self._decode_rows([(seq, list(tokens))], stream, "decode_verify")
        return self._argmax(ptr, len(tokens), stream)

    # ------------------------------------------------------------------ ModelLifecycle
    def teardown(self) -> None:
        """Free every device byte this model holds (weights, KV pool, workspaces, graphs)."""
        with self._guard:
            self._release_device()

    def _release_device(self) -> None:
        for g in self._graphs.values():
            self.backend.destroy_graph(g)
        self._graphs.clear()
        if self._weights is not None:
            self._weights.free()
            self._weights = None
        if self._ws is not None:
            self._ws.free()
        if not self._rope_table.is_null():
            self.backend.free(self._rope_table)
            self._rope_table = NULL

    def _copy_kv_block(self, src: int, dst: int, stream: int) -> None:
        ws = self._ws
        for layer in range(self._meta.num_layers):
            for base in (ws.k_cache(layer), ws.v_cache(layer)):
                self.backend.copy_d2d_async(base.offset(src * ws.block_bytes),
                                            base.offset(dst * ws.block_bytes),
                                            ws.block_bytes, stream)



def _check_options(block_size, max_batch, max_prefill_tokens, kv_blocks, max_seq_len) -> None:
    def bad(name, v, what):
        raise InvalidArgument(f"load option {name}={v!r}: {what}")
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1) \
            or block_size > 256:
        bad("block_size", block_size, "must be a power of two in [1, 256]")
    if not isinstance(max_batch, int) or not 1 <= max_batch <= 1024:
        bad("max_batch", max_batch, "must be an int in [1, 1024]")
    if not isinstance(max_prefill_tokens, int) or not 1 <= max_prefill_tokens <= 65536:
        bad("max_prefill_tokens", max_prefill_tokens, "must be an int in [1, 65536]")
    if kv_blocks is not None and (not isinstance(kv_blocks, int) or kv_blocks < 1):
        bad("kv_blocks", kv_blocks, "must be None or a positive int")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        bad("max_seq_len", max_seq_len, "must be None or a positive int")


def _nbytes_of(dst) -> int:
    if isinstance(dst, np.ndarray):
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise InvalidArgument("copy_logits_to_host: dst must be C-contiguous and writable")
        return dst.nbytes
    try:
        mv = memoryview(dst)
    except TypeError:
        raise InvalidArgument(f"copy_logits_to_host: dst must be a bytearray, memoryview or "
                              f"uint8 ndarray, got {type(dst).__name__}") from None
    if mv.readonly:
        raise InvalidArgument("copy_logits_to_host: dst is read-only")
    return mv.nbytes
