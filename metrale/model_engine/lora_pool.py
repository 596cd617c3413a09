"""LoRA adapter slots in device memory: `AdapterPool` (`metrale.load(..., max_loras=N,
max_lora_rank=R)`), owned by the model like its KV blocks.

Layout: one allocation. For every layer and every fused group the layer has (q|k|v, o and,
on a dense MLP layer, gate|up and down: the groups DecoderWeights fuses), three regions,
each holding all N slots back to back:
    A      [N][parts * rp][k]   BF16   part p's lora_A in rows p*rp .. p*rp + r_p - 1
    B      [N][n][rp]           BF16   lora_B rows of part p's outputs, columns 0 .. r_p - 1
    scale  [N][parts]           FP32   PEFT's scaling of each part (0 where not adapted)
rp = max_lora_rank rounded up to 16; ranks below rp, and modules an adapter does not adapt,
are zeros (their delta is exactly zero). A slot's regions are rewritten in place by a load
(`write_slot`): the addresses never move, so captured decode graphs, which read the pools
and the per-step tiles from device memory, serve any slot contents without a recapture.
Besides the slots: `t` (float32 [rows, 3 * rp], the shrink's output) and `tiles` (int32
[rows, 3], a step's row tiles), rows = the workspace's largest pass; on a tensor-parallel
rank `t_all` (float32 [ranks, rows, rp]: the ranks' gathered partial x A^T of o and down)
and the rank's slices of each adapter (tp/lora_shard.py) in the rank's layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..formats.lora import MAX_RANK, LoraAdapter
from ..gpu_runtime.types import DevicePtr

_ALIGN = 256


@dataclass(frozen=True)
class GroupRegion:
    """One (layer, fused group)'s regions: byte offsets of slot 0 in the pool, strides in
    elements per slot, its k (in-features), n (out-features) and part ends."""

    layer: int
    group: str            # "qkv" | "o" | "gate_up" | "down"
    k: int
    ends: tuple[int, ...]
    rp: int
    a_off: int
    b_off: int
    s_off: int

    @property
    def n(self) -> int:
        return self.ends[-1]

    @property
    def parts(self) -> int:
        return len(self.ends)

    @property
    def c(self) -> int:
        return self.parts * self.rp

    @property
    def a_stride(self) -> int:
        return self.c * self.k

    @property
    def b_stride(self) -> int:
        return self.n * self.rp


@dataclass
class LoraSlot:
    """What a slot holds: an adapter's name ("" = empty), where it came from, its rank and
    projections, its generation (bumped by every load into the slot: the prefix-cache id
    changes with the contents), in-flight sequences and the last-use tick."""

    name: str = ""
    path: str = ""
    rank: int = 0
    kinds: tuple[str, ...] = ()
    generation: int = 0
    refs: int = 0
    last_used: int = 0
    pinned: bool = False


def padded_rank(max_rank: int) -> int:
    return -(-int(max_rank) // 16) * 16


def check_slot_options(max_loras, max_lora_rank) -> None:
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or \
            not 0 <= max_loras <= 1024:
        raise InvalidArgument(f"load option max_loras={max_loras!r}: must be an int in [0, 1024]")
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or \
            not 1 <= max_lora_rank <= MAX_RANK:
        raise InvalidArgument(f"load option max_lora_rank={max_lora_rank!r}: must be an int in "
                              f"[1, {MAX_RANK}]")


def layout(meta, n_slots: int, max_rank: int) -> tuple[list[GroupRegion], int]:
    """Every (layer, group) region of a pool of `n_slots` slots and its total bytes."""
    rp = padded_rank(max_rank)
    h, d = meta.hidden_size, meta.head_dim
    q, kv, inter = meta.num_heads * d, meta.num_kv_heads * d, meta.intermediate_size
    moe = getattr(meta, "moe", None)
    regions, off = [], 0

    def take(nbytes: int) -> int:
        nonlocal off
        at = off
        off += -(-nbytes // _ALIGN) * _ALIGN
        return at
    for i in range(meta.num_layers):
        groups = [("qkv", h, (q, q + kv, q + 2 * kv)), ("o", q, (h,))]
        if moe is None or not moe.sparse_layers[i]:
            groups += [("gate_up", h, (inter, 2 * inter)), ("down", inter, (h,))]
        for name, k, ends in groups:
            c = len(ends) * rp
            a = take(n_slots * c * k * 2)
            b = take(n_slots * ends[-1] * rp * 2)
            s = take(n_slots * len(ends) * 4)
            regions.append(GroupRegion(i, name, k, ends, rp, a, b, s))
    return regions, off


def slot_bytes(regions) -> int:
    """Bytes one slot holds in `regions` (A, B and scales over every layer and group)."""
    return sum((r.a_stride + r.b_stride) * 2 + r.parts * 4 for r in regions)


def pool_bytes(meta, n_slots: int, max_rank: int, rows: int, ranks: int = 1) -> int:
    """Device bytes of an AdapterPool: the slots, `t`, `tiles` (and `t_all` on a rank)."""
    rp = padded_rank(max_rank)
    gathered = ranks * rows * rp * 4 if ranks > 1 else 0
    return layout(meta, n_slots, max_rank)[1] + rows * 3 * rp * 4 + rows * 3 * 4 + gathered


class AdapterPool:
    """`n_slots` adapter slots of rank <= `max_rank` for a model of metadata `meta`, plus
    the per-pass buffers for up to `rows` rows. `free()` returns every byte."""

    def __init__(self, backend, meta, n_slots: int, max_rank: int, rows: int,
                 where: str, shard=None, ranks: int = 1) -> None:
        # shard: adapter -> this tensor-parallel rank's slice of it (meta is the rank's)
        if meta.architecture not in ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe",
                                     "qwen3_moe", "mixtral"):
            raise Unsupported(f"{where}: LoRA slots (max_loras) are served on decoder "
                              f"checkpoints, not {meta.architecture}")
        self.backend, self.meta = backend, meta
        self.n_slots, self.max_rank, self.rp = n_slots, max_rank, padded_rank(max_rank)
        self.regions, self.slot_area = layout(meta, n_slots, max_rank)
        self._by_key = {(r.layer, r.group): r for r in self.regions}
        self.rows, self.shard, self.ranks = rows, shard, ranks
        self.nbytes = pool_bytes(meta, n_slots, max_rank, rows, ranks)
        self.slots = [LoraSlot() for _ in range(n_slots)]
        self.tick = 0
        self.base = self.t = self.tiles = self.t_all = None
        try:
            self.base = backend.alloc(self.slot_area)
            backend.memset(self.base, 0, self.slot_area)
            self.t = backend.alloc(rows * 3 * self.rp * 4)
            self.tiles = backend.alloc(rows * 3 * 4)
            if ranks > 1:
                self.t_all = backend.alloc(ranks * rows * self.rp * 4)
        except BaseException:
            self.free()
            raise

    def region(self, layer: int, group: str) -> GroupRegion | None:
        return self._by_key.get((layer, group))

    def ptr(self, off: int) -> DevicePtr:
        return DevicePtr(self.base).offset(off)

    def slot_bytes(self) -> int:
        return slot_bytes(self.regions)

    def write_slot(self, slot: int, adapter: LoraAdapter | None, stream: int) -> None:
        """Slot `slot`'s regions := `adapter` (zeros where it adapts nothing; None: all
        zeros), copied in order on `stream`. The caller has checked the slot is idle and the
        adapter's ranks fit."""
        b = self.backend
        if adapter is not None and self.shard is not None:
            adapter = self.shard(adapter)
        mods: dict[tuple[int, str], list] = {}
        for mod in (adapter.modules if adapter is not None else ()):
            group, part = mod.group
            mods.setdefault((mod.layer, group), []).append((part, mod))
        for r in self.regions:
            a_ptr = self.ptr(r.a_off).offset(2 * slot * r.a_stride)
            b_ptr = self.ptr(r.b_off).offset(2 * slot * r.b_stride)
            s_ptr = self.ptr(r.s_off).offset(4 * slot * r.parts)
            got = mods.get((r.layer, r.group))
            if not got:
                b.memset_async(a_ptr, 0, 2 * r.a_stride, stream)
                b.memset_async(b_ptr, 0, 2 * r.b_stride, stream)
                b.memset_async(s_ptr, 0, 4 * r.parts, stream)
                continue
            a = np.zeros((r.c, r.k), np.uint16)
            bb = np.zeros((r.n, r.rp), np.uint16)
            scale = np.zeros(r.parts, np.float32)
            starts = (0,) + r.ends[:-1]
            for part, mod in got:
                a[part * r.rp: part * r.rp + mod.rank] = mod.a
                bb[starts[part]: r.ends[part], :mod.rank] = mod.b
                scale[part] = mod.scale
            for host, ptr in ((a, a_ptr), (bb, b_ptr), (scale, s_ptr)):
                b.copy_h2d_async(host, ptr, stream)
        b.synchronize(stream)   # the host arrays above must outlive the copies

    def free(self) -> None:
        for name in ("base", "t", "tiles", "t_all"):
            p = getattr(self, name)
            if p is not None:
                self.backend.free(p)
                setattr(self, name, None)
