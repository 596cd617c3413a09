"""DeepSeek-V3's multi-token-prediction (MTP) module as the model's draft proposer (the
original's `MtpHead` behind `ModelDraft`; model_engine/draft.py routes the methods here).

The module (`model.layers.{num_hidden_layers}.*`, DeepSeek-V3 report section 2.2) turns a
pair (the target's hidden state h_k at position k, the token t_{k+1} after it) into logits
for t_{k+2}:

    x = eh_proj([enorm(embed(t_{k+1})) | hnorm(h_k)])     the embedding half first, as the
                                                            released eh_proj's columns are
                                                            (run as its two halves' sum)
    y = one decoder block (MLA attention + DeepSeek MoE) on x, at rope position k + 1
    logits = shared_head.head(shared_head.norm(y))
h_k is the residual stream before the final norm (the report's h^0 is the main model's
output representation; the final norm belongs to its output head, as shared_head.norm
does here); it is the row `save_hidden_for_mtp` saves, as the original keeps the raw hidden
for every family but GLM.

Pair key k keeps its latent in the module's own cache (`MtpCache`: the pool's layout, one
layer) at the slot of the sequence's position k, so it lives in the sequence's own blocks:
the MTP's attention over keys 0..k is the pool's latent attention over that sequence with
this cache. A sequence's true pairs (hidden from the target) are recorded on it
(`seq.proposer_state`: the token of each key); a propose first feeds the keys still
missing from the rows the last `save_hidden_for_mtp` saved, then drafts: draft 1 from the
pair (h_{p-1}, token) at key p - 1, draft j + 1 from (the module's own output y, draft j) at
key p - 1 + j (chain rows, never recorded as true pairs; past the sequence's blocks they
use scratch blocks of the cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import Unsupported
from ..formats.deepseek_config import deepseek_layer_tensors
from ..formats.deepseek_moe_config import deepseek_moe_tensors
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import DevicePtr
from .memory_plan import held_bytes_of


@dataclass
class MtpState:
    """`seq.proposer_state` of a sequence an MTP model drafts for: `tokens[k]` is the token
    t_{k+1} of pair key k, for the keys whose latent in the MTP cache is a true pair."""

    tokens: list[int] = field(default_factory=list)


def mtp_prefix(meta) -> str:
    return f"model.layers.{meta.num_layers}."


def mtp_tensors(meta) -> dict[str, tuple[int, ...]]:
    """The MTP module's tensors (name -> shape), as DeepSeek-V3 releases them; its own
    `embed_tokens` and `shared_head.head` are optional (`MTP_SHARED`)."""
    p, h, i = mtp_prefix(meta), meta.hidden_size, meta.intermediate_size
    t = {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
         p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
         p + "shared_head.norm.weight": (h,)}
    t.update(deepseek_layer_tensors(meta, p))
    if mtp_sparse(meta):
        t.update(deepseek_moe_tensors(meta, p))
    else:
        t.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i)})
    return t


# the main model's tensors the module shares when the checkpoint has no copy of its own
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}


def mtp_sparse(meta) -> bool:
    """Whether the MTP block is a MoE block: layer index num_hidden_layers is past
    first_k_dense_replace exactly when the main model's last layer is (moe_layer_freq 1)."""
    return bool(meta.moe is not None and meta.moe.sparse_layers and meta.moe.sparse_layers[-1])


def mtp_to_load(source, meta, option) -> dict[str, tuple[int, ...]] | None:
    """The MTP tensors to load (checked: presence, shape, dtype), or None.

    option None: load when the checkpoint holds the module (its `enorm`); True: required
    (Unsupported for a model without one, FormatError naming a missing tensor); False: not
    loaded. Only the first of num_nextn_predict_layers modules drafts (V3 releases one)."""
    from ..formats.source import check_tensors
    if option not in (None, True, False):
        raise Unsupported(f"mtp must be None, True or False, got {option!r}")
    if option is False:
        return None
    if meta.architecture != "deepseek_v3" or meta.mla is None:
        if option:
            raise Unsupported(f"{source.description}: mtp=True: {meta.architecture} has no "
                              "multi-token-prediction module metrale drafts with (deepseek_v3's "
                              "only)")
        return None
    if meta.quantization is not None:
        # the released FP8 checkpoints hold an FP8 MTP layer: its weights would need the
        # quantized upload (not built for it), so it stays held but unread
        if option:
            raise Unsupported(f"{source.description}: mtp=True: the MTP module of a quantized "
                              f"checkpoint ({meta.quantization.method}) is not supported; "
                              "load with mtp=None or False")
        return None
    t = mtp_tensors(meta)
    have = set(source.tensor_names())
    if option is None and mtp_prefix(meta) + "enorm.weight" not in have:
        return None
    check_tensors(source, t, complete=False)
    for own in MTP_SHARED:
        name = mtp_prefix(meta) + own
        if name in have:
            t[name] = (meta.vocab_size, meta.hidden_size)
    check_tensors(source, t, complete=False)
    return t


def mtp_weight_bytes(tensors) -> int:
    return sum(held_bytes_of(n, s) for n, s in tensors.items()) if tensors else 0


@dataclass
class MtpWeights:
    enorm: DevicePtr
    hnorm: DevicePtr
    eh_e: DevicePtr          # eh_proj's embedding half [hidden, hidden] (its first columns)
    eh_h: DevicePtr          # eh_proj's hidden half [hidden, hidden]
    block: object            # MlaLayerWeights
    norm: DevicePtr          # shared_head.norm
    head: DevicePtr          # shared_head.head [vocab, hidden] (or lm_head's)
    embed: DevicePtr         # its embed_tokens [vocab, hidden] (or the main table)


def upload_mtp(weights, source, meta, tensors, progress: bool) -> MtpWeights:
    """Upload the module into `weights` (the model's DeepseekWeights, which frees it and
    counts its bytes in `nbytes`)."""
    p = mtp_prefix(meta)
    weights.nbytes += mtp_weight_bytes(tensors)
    with WeightUploader(weights.backend, source, mtp_weight_bytes(tensors),
                        desc=f"{source.description} (MTP)", progress=progress) as up:
        own = lambda name: weights._own(up.upload(p + name))   # noqa: E731
        block = weights.upload_layer(up, meta, p, mtp_sparse(meta))
        embed = own("embed_tokens.weight") if p + "embed_tokens.weight" in tensors \
            else weights.embed_tokens
        head = own("shared_head.head.weight") if p + "shared_head.head.weight" in tensors \
            else weights.lm_head
        # eh_proj's two column halves apart: x = e @ We^T + h @ Wh^T, each half a GEMM
        # of its own rows, no concatenated input row to assemble
        eh = np.asarray(source.read_bf16(p + "eh_proj.weight"))
        h = meta.hidden_size
        eh_e, eh_h = (weights._own(up.upload_array(np.ascontiguousarray(eh[:, c:c + h])))
                      for c in (0, h))
        return MtpWeights(enorm=own("enorm.weight"), hnorm=own("hnorm.weight"),
                          eh_e=eh_e, eh_h=eh_h, block=block,
                          norm=own("shared_head.norm.weight"), head=head, embed=embed)


def scratch_blocks(block_size: int, max_chain: int) -> int:
    """Cache blocks past the pool's a chain of `max_chain` rows may need beyond a
    sequence's last block."""
    return -(-max_chain // block_size) + 1


class MtpBuffers(OwnedBuffers):
    """The module's device buffers: its latent cache (the pool's blocks, the pad block and
    `scratch` blocks), the saved target hidden rows, the pass's normed rows and its logits."""

    def __init__(self, backend, meta, ws, *, num_blocks: int, scratch: int, max_chain: int,
                 logit_bytes: int) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        T, hid = ws.max_tokens, meta.hidden_size
        self.first_scratch = num_blocks + 1
        self.scratch = scratch
        try:
            a = self._alloc
            self.cache = a((num_blocks + 1 + scratch) * ws.block_bytes)
            self.saved = a(T * hid * 2)       # target hidden rows (save_hidden_for_mtp)
            self.chain = a(hid * 2)           # the module's own output row, for a chain row
            self.e = a(T * hid * 2)           # embeddings, then hnorm(h)
            self.normed = a(T * hid * 2)
            self.logits = a(max_chain * meta.vocab_size * logit_bytes)
        except BaseException:
            self.free()
            raise

    @staticmethod
    def estimate_bytes(meta, *, max_tokens: int, block_bytes: int, num_blocks: int,
                       scratch: int, max_chain: int, logit_bytes: int) -> int:
        T, hid = max_tokens, meta.hidden_size
        return ((num_blocks + 1 + scratch) * block_bytes + 3 * T * hid * 2 + hid * 2 +
                max_chain * meta.vocab_size * logit_bytes)


def mtp_state(seq) -> MtpState:
    """The sequence's MTP state (made on its first propose)."""
    st = getattr(seq, "proposer_state", None)
    if not isinstance(st, MtpState):   # (a sequence's state is only ever an MtpState)
        st = seq.proposer_state = MtpState()
    return st
