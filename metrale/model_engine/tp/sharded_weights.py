"""One tensor-parallel rank's weights on its device: the slices of `shard.ShardPlan`, fused
like `weights.DecoderWeights` (q|k|v, gate|up) and held in the same `LayerWeights`, so the
layer passes read them the same way.

Every tensor of the whole checkpoint is checked (presence, shape, dtype) before the first
byte goes up, exactly as on one device; a slice is read from the checkpoint's mmap (rows are
a view, columns one copy of the slice) and uploaded alone, so a rank never holds more than
one tensor's slice in host memory. A failed load frees everything it allocated.
"""
from __future__ import annotations

import numpy as np

from ...errors import FormatError
from ...formats import check_tensors, expected_tensors
from ...formats.upload import WeightUploader
from ...gpu_runtime.owned import OwnedBuffers
from ...gpu_runtime.types import NULL, DevicePtr
from ...formats.quant.checkpoint import check_quantized
from .moe_shard import upload_moe_shard
from .quant_weights import check_row_parallel, quantized, upload_columns, upload_rows
from .shard import ShardPlan, rank_weight_bytes
from ..weights import LayerWeights


class ShardedDecoderWeights(OwnedBuffers):
    """Rank `plan.rank`'s slice of a llama/mistral/qwen2/qwen3 checkpoint; `free()` returns
    every byte. Attributes as `DecoderWeights` (embed_tokens and lm_head hold the rank's
    vocabulary rows, `plan.vocab_shard` of them)."""

    def __init__(self, backend, source, meta, plan: ShardPlan, progress: bool = True) -> None:
        self.backend = backend
        self.plan = plan
        self._owned: list[DevicePtr] = []
        self._source = source
        expected = expected_tensors(meta, source.tensor_names())
        if meta.quantization is None:
            check_tensors(source, expected)
        else:   # quantized linears (tp/quant_weights.py): checked as on one device, and
            # every rank's input-column slice checked against the format
            check_quantized(source, meta)
            check_row_parallel(meta, plan, f"{source.description}")
        tied = "lm_head.weight" not in expected
        self.nbytes = rank_weight_bytes(meta, plan, tied)
        self.held = 0   # bytes uploaded: this rank's weights as held (packed where quantized)
        self._meta = meta
        D = meta.head_dim
        q = (plan.head_start * D, (plan.head_start + plan.num_heads) * D)
        kv = (plan.kv_head_start * D, (plan.kv_head_start + plan.num_kv_heads) * D)
        inter = (plan.inter_start, plan.inter_start + plan.intermediate)
        try:
            with WeightUploader(backend, source, self.nbytes,
                                desc=f"{source.description} (rank {plan.rank})",
                                progress=progress) as up:
                self._up = up
                self.embed_tokens = self._vocab_rows("model.embed_tokens.weight")
                self.layers: list[LayerWeights] = []
                for i in range(meta.num_layers):
                    p = f"model.layers.{i}."
                    att = p + "self_attn."
                    qkv_parts = [(att + "q_proj", q), (att + "k_proj", kv), (att + "v_proj", kv)]
                    gu_parts = [(p + "mlp.gate_proj", inter), (p + "mlp.up_proj", inter)]
                    moe = upload_moe_shard(self, meta, plan, i)   # None: a dense MLP
                    self.layers.append(LayerWeights(
                        input_layernorm=self._whole(p + "input_layernorm.weight"),
                        qkv=self._linear_rows(qkv_parts),
                        qkv_bias=(self._rows([(n + ".bias", r) for n, r in qkv_parts])
                                  if meta.attention_bias else NULL),
                        q_norm=self._whole(att + "q_norm.weight") if meta.qk_norm else NULL,
                        k_norm=self._whole(att + "k_norm.weight") if meta.qk_norm else NULL,
                        o_proj=self._linear_columns(att + "o_proj", q),
                        o_bias=(self._whole(att + "o_proj.bias") if meta.o_proj_bias
                                else NULL),
                        post_attention_layernorm=self._whole(
                            p + "post_attention_layernorm.weight"),
                        gate_up=self._linear_rows(gu_parts) if moe is None else NULL,
                        gate_up_bias=(self._rows([(n + ".bias", r) for n, r in gu_parts])
                                      if meta.mlp_bias else NULL),
                        down_proj=(self._linear_columns(p + "mlp.down_proj", inter)
                                   if moe is None else NULL),
                        down_bias=(self._whole(p + "mlp.down_proj.bias") if meta.mlp_bias
                                   else NULL),
                        moe=moe,
                    ))
                self.norm = self._whole("model.norm.weight")
                self.lm_head = (self.embed_tokens if tied else
                                self._vocab_rows("lm_head.weight") if not quantized(meta, "lm_head")
                                else upload_rows(self, meta, [("lm_head", (
                                    plan.vocab_start, plan.vocab_start + plan.vocab_rows))],
                                    pad_to=plan.vocab_shard))
                if meta.quantization is not None or meta.moe is not None:
                    self.nbytes = self.held   # measured (the plan's figure is BF16 dense)
        except BaseException:
            self.free()
            raise
        finally:
            self._up = self._source = None

    # slices ----------------------------------------------------------------------------
    def _read(self, name: str) -> np.ndarray:
        arr = self._source.read_bf16(name)
        if arr.dtype != np.uint16:
            raise FormatError(f"{self._source.description}: read_bf16({name!r}) returned "
                              f"{arr.dtype}, not uint16 BF16 bits")
        return arr

    def _upload(self, arr: np.ndarray) -> DevicePtr:
        ptr = self._own(self.backend.alloc(arr.nbytes))
        self._up.upload_array(arr, ptr)
        self.held += arr.nbytes
        return ptr

    def _whole(self, name: str) -> DevicePtr:
        return self._upload(self._read(name))

    def _rows(self, parts) -> DevicePtr:
        """Rows [a, b) of each (name, (a, b)) concatenated along dim 0 (fused q|k|v, gate|up)."""
        return self._upload(np.concatenate([self._read(n)[a:b] for n, (a, b) in parts]))

    def _columns(self, name: str, span) -> DevicePtr:
        """Columns [a, b) of a [out, in] weight: the rank's slice of a row-parallel layer."""
        a, b = span
        return self._upload(np.ascontiguousarray(self._read(name)[:, a:b]))

    def _linear_rows(self, parts):
        """A column-parallel linear: rows of each (module, span), BF16 or quantized."""
        if any(quantized(self._meta, m) for m, _ in parts):
            return upload_rows(self, self._meta, parts)
        return self._rows([(m + ".weight", r) for m, r in parts])

    def _linear_columns(self, module: str, span):
        """A row-parallel linear: the rank's input columns, BF16 or quantized."""
        if quantized(self._meta, module):
            return upload_columns(self, self._meta, module, span)
        return self._columns(module + ".weight", span)

    def _vocab_rows(self, name: str) -> DevicePtr:
        """The rank's vocabulary rows, zero rows after the vocabulary's end."""
        p = self.plan
        full = self._read(name)
        rows = np.zeros((p.vocab_shard, full.shape[1]), np.uint16)
        rows[:p.vocab_rows] = full[p.vocab_start:p.vocab_start + p.vocab_rows]
        return self._upload(rows)
