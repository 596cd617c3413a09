"""`TransformerModel`: the pointer API for decoder-only checkpoints (llama, mistral, qwen2,
qwen3), composed from the mixins exactly as the original engine's split supertraits
(`crates/model-engine/src/traits/model.rs`: ModelLifecycle, ModelForward, ModelLogits,
ModelAdapters, ModelSsmState, ModelVerify, ModelDraft, ModelEp, ModelStreams,
ModelDeviceFeed, ModelCircuit; vision lives in `metrale.vision`).

Forward paths (all on `self._ws` buffers allocated at load), every one writing its logits
into the one shared arena at `logits_buffer_ptr()` (valid until the next forward pass):
  prefill / prefill_chunk / batched prefill (prefill.py) — causal paged attention; the
      last position's row at row 0 (row_base + i when batched).
  decode / decode_batch / decode_verify — one query row per (sequence, position), split-K
      decode attention; rows 0..n-1. With graphs on (the default on CUDA and CPU),
      replayed from graphs captured per `padded_batch_n` rung (on CPU per row count).
  Every linear layer and the lm_head of every path is the batch-invariant tensor-core GEMM
  (ops.gemm_tc): a row's products never depend on how many rows share the launch.
Stream handle 0 is the model's default stream in every entry point (streams.py).
Every check (token ids, lengths, positions, pool capacity) happens before the first launch.
"""
from __future__ import annotations

import math
from typing import Sequence

from ..errors import InvalidArgument, Unsupported
from ..gpu_runtime.types import NULL, DevicePtr
from ..kv.block_pool import BlockPool
from ..ops import rope
from .args import list_arg
from .draft import TransformerDraft
from .forward import ModelForward
from .gguf_weights import keeps_packed
from .guard import CallGuard, exclusive
from .kv_groups import KvGroup, group_layers, window_blocks
from .lifecycle import ModelLifecycle
from .lora_options import lora_options
from .tp.lora_shard import shard_adapter
from .logits import ModelLogits
from .passes import DecoderPasses
from .prefill import PromptPrefill
from .prefix_reclaim import PrefixReclaimFor
from .adapters import ModelAdapters
from .probes import ModelCircuit, ModelDeviceFeed, ModelDraft, ModelEp
from .readout import LogitsReadout
from .sequence import SequenceState
from .ssm_state import ModelSsmState
from .streams import ModelStreams
from .verify import ModelVerify
from .deepseek import DeepseekWeights
from .mtp import MtpBuffers, mtp_to_load, mtp_weight_bytes, scratch_blocks
from .mtp_proposer import MtpProposer
from .weights import DecoderWeights, check_checkpoint
from .workspace import Workspace

DECODER_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                         "mixtral", "gemma2", "gemma3_text", "gemma3", "phi3", "gpt_oss",
                         "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite")
MAX_VERIFY_ROWS = 16


class TransformerModel(LogitsReadout, PromptPrefill, TransformerDraft, PrefixReclaimFor,
                       ModelLogits, ModelForward, ModelAdapters, ModelLifecycle,
                       ModelVerify, ModelStreams, ModelDraft, ModelSsmState,
                       ModelEp, ModelDeviceFeed, ModelCircuit, DecoderPasses):
    """A decoder-only model on a `GpuBackend`, driven through raw pointers."""

    def __init__(self, backend, source, *, kv_blocks: int | None = None, block_size: int = 16,
                 max_batch: int = 64, fp32_logits: bool = False,
                 max_prefill_tokens: int = 2048, max_seq_len: int | None = None,
                 graphs: bool | None = None, progress: bool = True,
                 gguf_dequantize: bool = False, max_loras: int = 0,
                 max_lora_rank: int | None = None, loras=None, mtp: bool | None = None,
                 _shard=None) -> None:
        # _shard: a tensor-parallel rank's slices and group (tp/model.py), else None.
        # gguf_dequantize: a GGUF's block-type weights dequantized to BF16 at load instead
        # of kept at their bytes (gguf_weights.py; a rank's slices always are, for now)
        # max_loras / max_lora_rank / loras: LoRA adapter slots (lora_options.py)
        # mtp: DeepSeek-V3's MTP module as the draft proposer: None loads it when the
        # checkpoint has it, True requires it, False leaves it unloaded (mtp.mtp_to_load)
        meta = source.metadata()
        if meta.architecture not in DECODER_ARCHITECTURES:
            raise Unsupported(f"{source.description}: model_type {meta.architecture!r} is not "
                              f"a decoder-only architecture ({', '.join(DECODER_ARCHITECTURES)})")
        _check_options(block_size, max_batch, max_prefill_tokens, kv_blocks, max_seq_len)
        if meta.mla is not None and (_shard is not None or max_loras or loras):
            raise Unsupported(f"{source.description}: {meta.architecture} (multi-head latent "
                              "attention): LoRA adapters and tensor parallelism are not "
                              "served on it")
        lora_opts = lora_options(source, meta, max_loras, max_lora_rank, loras)
        self.backend = backend
        self._meta = meta
        self._guard = CallGuard()
        self.use_fp32_logits = bool(fp32_logits)
        self._block_size = block_size
        # query_pre_attn_scalar ** -0.5 for Gemma (formats/decoder_variant.py)
        self._attn_scale = meta.variant.attn_scale or 1.0 / math.sqrt(meta.head_dim)
        max_rows = max(max_batch, MAX_VERIFY_ROWS)
        self._max_batch = max_batch
        self._weights = self._ws = None
        self._rope_table = NULL
        self._layer_rope: list[DevicePtr] = []   # per layer: its rope table (_rope_tables')
        self._rope_tables: list[DevicePtr] = []
        self._tp = None   # a rank's combines (tp/runtime.py: TensorParallel), or None
        # the head / intermediate counts the layer passes run with (a rank's own slice)
        self._layer_meta = meta if _shard is None else _shard.layer_metadata(meta)
        self._graphs: dict = {}   # padded rows (or (rows, "lora")) -> decode graph
        # decode graphs unless told: the backend's default (protocol.py)
        self._use_graphs = backend.decode_graphs_by_default if graphs is None else bool(graphs)
        # the checkpoint's tensors against the config before the plan is sized by it: a
        # wrong size is refused naming the tensor, not as memory the model cannot need
        check_checkpoint(source, meta)
        packed = _shard is None and not gguf_dequantize and keeps_packed(source)
        lora_rows = max(max_prefill_tokens, max_rows)
        ranks = 1 if _shard is None else _shard.plan.size
        lora_bytes = lora_opts.device_bytes(self._layer_meta, lora_rows, ranks)
        mtp_tensors = mtp_to_load(source, meta, mtp) if _shard is None else None
        self._mtp = None
        if mtp_tensors:   # its weights and buffers beside the pool; its cache as a layer's
            lora_bytes += mtp_weight_bytes(mtp_tensors) + MtpBuffers.estimate_bytes(
                meta, max_tokens=max_prefill_tokens, block_bytes=0, num_blocks=0,
                scratch=0, max_chain=MAX_VERIFY_ROWS - 1,
                logit_bytes=4 if fp32_logits else 2) + (1 + scratch_blocks(
                    block_size, MAX_VERIFY_ROWS - 1)) * block_size * meta.mla.latent_dim * 2
        from .memory_plan import plan_memory
        plan = plan_memory(backend, self._layer_meta, kv_blocks=kv_blocks,
                           block_size=block_size, max_rows=max_rows,
                           max_tokens=max_prefill_tokens, max_seq_len=max_seq_len,
                           fp32_logits=self.use_fp32_logits, where=source.description,
                           packed_source=source if packed else None,
                           extra_kv_layers=1 if mtp_tensors else 0,
                           **(dict(extra_bytes=lora_bytes) if _shard is None else dict(
                               rank_weight_bytes=_shard.weight_bytes(meta, source),
                               extra_bytes=lora_bytes + _shard.buffer_bytes(
                                   meta, max_tokens=max_prefill_tokens, logits_rows=2 * max_rows,
                                   fp32_logits=self.use_fp32_logits))))
        if _shard is not None:
            plan = _shard.agree_plan(plan, block_size)
        self._max_seq_len = plan.max_seq_len
        self._max_positions = plan.max_seq_len
        # KV groups (kv_groups.py): the primary pool, and a bounded one for sliding-window
        # layers beside full ones
        groups = group_layers(meta)
        win_layers = groups[1][1] if len(groups) > 1 else ()
        win_blocks = window_blocks(plan.num_blocks, groups[-1][0], block_size, max_rows,
                                   max_prefill_tokens) if win_layers else 0
        try:
            self._weights = (DecoderWeights(backend, source, meta, progress=progress,
                                            packed=packed)
                             if _shard is None and meta.mla is None else
                             DeepseekWeights(backend, source, meta, progress=progress)
                             if _shard is None else
                             _shard.upload_weights(backend, source, meta, progress))
            self._ws = Workspace(backend, self._layer_meta, max_tokens=max_prefill_tokens,
                                 max_rows=max_rows, num_blocks=plan.num_blocks,
                                 block_size=block_size,
                                 max_blocks_per_seq=plan.max_blocks_per_seq,
                                 fp32_logits=self.use_fp32_logits,
                                 window_layers=win_layers, window_blocks=win_blocks)
            if _shard is not None:
                self._tp = _shard.runtime(backend, meta, self._ws, self.use_fp32_logits)
            self._upload_rope_tables(meta)
            self._lora = lora_opts.make_pool(
                backend, self._layer_meta, lora_rows, source.description, ranks=ranks,
                shard=None if _shard is None else
                (lambda a: shard_adapter(a, _shard.plan, meta.head_dim)))
            for slot, (name, adapter) in enumerate(lora_opts.loras):   # pinned, read
                self._load_slot(adapter, name, slot, "loras", startup=True)
            if mtp_tensors:
                self._mtp = MtpProposer(self, source, mtp_tensors,
                                        max_chain=MAX_VERIFY_ROWS - 1, progress=progress)
        except BaseException:
            self._release_device()
            raise
        self._pool = BlockPool(plan.num_blocks, block_size)
        self._kv_groups = [KvGroup(self._pool, "block_table", "reserved_blocks", groups[0][0],
                                   groups[0][1])]
        if win_layers:
            self._kv_groups.append(KvGroup(BlockPool(win_blocks, block_size), "window_table",
                                           "window_reserved", groups[1][0], win_layers))
        # per layer: its group (0 primary, 1 the sliding-window pool)
        self._layer_group = [0] * meta.num_layers
        for i in win_layers:
            self._layer_group[i] = 1
        self.source_description = source.description

    def metadata(self):
        return self._meta

    def weight_bytes(self) -> int:
        """Device bytes the weights hold (a GGUF kept packed: its planes' bytes; additive:
        not in the original engine)."""
        return int(self._weights.nbytes)

    # ------------------------------------------------------------------ ModelForward
    def kv_block_size(self) -> int:
        return self._block_size

    @exclusive
    def decode(self, token: int, seq: SequenceState, stream: int) -> DevicePtr:
        return self._decode_rows([(seq, [token])], self._stream_of(stream), "decode")

    @exclusive
    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: int) -> DevicePtr:
        stream = self._stream_of(stream)
        tokens, seqs = list_arg("decode_batch", tokens), list_arg("decode_batch", seqs)
        self._check_decode_batch(tokens, seqs, "decode_batch")
        return self._decode_rows([(s, [t]) for s, t in zip(seqs, tokens)], stream,
                                 "decode_batch")

    # ------------------------------------------------------------------ ModelVerify
    @exclusive
    def decode_verify(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> list[int]:
        """As the original's `decode_verify_dispatch` (trait_impl/verify_a.rs): no tokens
        give `[]` (nothing runs); otherwise every token is appended and one argmax id per
        token comes back. The original has no fixed width: k rows must fit its logits
        buffer. Here they must fit the workspace's rows (`max_verify_tokens()`, at least
        16), else InvalidArgument before anything runs."""
        tokens = list_arg("decode_verify", tokens)
        if not tokens:
            self._check_seq(seq)
            self._stream_of(stream)
            return []
        if len(tokens) > self._ws.max_rows:
            raise InvalidArgument(f"decode_verify: {len(tokens)} tokens exceed the "
                                  f"{self._ws.max_rows} verify rows of the workspace "
                                  f"(max(max_batch, {MAX_VERIFY_ROWS}))")
        stream = self._stream_of(stream)
        ptr = self._decode_rows([(seq, list(tokens))], stream, "decode_verify")
        return self._argmax(ptr, len(tokens), stream, "decode_verify")

    def max_verify_tokens(self) -> int:
        """Most tokens one `decode_verify` takes: the workspace's rows, max(max_batch, 16).
        Additive (the original's bound is its logits buffer, not exposed)."""
        return self._ws.max_rows

    # ------------------------------------------------------------------ ModelLifecycle
    def teardown(self) -> None:
        """Free every device byte this model holds (weights, KV pool, workspaces, graphs)."""
        with self._guard:
            self._release_device()

    def _release_device(self) -> None:
        for g in self._graphs.values():
            self.backend.destroy_graph(g)
        self._graphs.clear()
        if self._mtp is not None:
            self._mtp.free()
            self._mtp = None
        if self._weights is not None:
            self._weights.free()
            self._weights = None
        if self._ws is not None:
            self._ws.free()
        if self._order_event is not None:
            self.backend.destroy_event(self._order_event)
            self._order_event = None
        if self._tp is not None:
            self._tp.free()
        if self._lora is not None:
            self._lora.free()
            self._lora = None
        for t in self._rope_tables:
            self.backend.free(t)
        self._rope_tables.clear()
        self._layer_rope.clear()
        self._rope_table = NULL

    def _upload_rope_tables(self, meta) -> None:
        """One cos/sin table per distinct rope of the layers (Gemma 3: the full layers' and
        the sliding layers' local one), over the rotary dims (partial rotary: fewer)."""
        rd = meta.variant.rotary_dim or meta.head_dim
        by_rope: dict[str, DevicePtr] = {}
        for window in meta.layer_windows or (0,) * meta.num_layers:
            theta, scaling = meta.variant.rope_of_layer(meta, window)
            key = repr((theta, scaling))
            if key not in by_rope:
                table = rope.rope_table(rd, self._max_positions, theta, scaling)
                by_rope[key] = self.backend.alloc(table.nbytes)
                self._rope_tables.append(by_rope[key])
                self.backend.copy_h2d(table, by_rope[key])
            self._layer_rope.append(by_rope[key])
        self._rope_table = self._layer_rope[0]
        # rows of every table: max_positions, twice that for LongRoPE (its second half)
        self._rope_rows = table.shape[0]

    def _copy_kv_block(self, src: int, dst: int, stream: int, group: int = 0) -> None:
        ws = self._ws
        for layer in self._kv_groups[group].layers:
            for base in (ws.k_cache(layer), ws.v_cache(layer)):
                self.backend.copy_d2d_async(base.offset(src * ws.block_bytes),
                                            base.offset(dst * ws.block_bytes),
                                            ws.block_bytes, stream)
        if self._mtp is not None and group == 0:   # the MTP's latents live in the same blocks
            cache = self._mtp.buffers.cache
            self.backend.copy_d2d_async(cache.offset(src * ws.block_bytes),
                                        cache.offset(dst * ws.block_bytes), ws.block_bytes,
                                        stream)


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

