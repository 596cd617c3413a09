"""The grouped LoRA GEMMs (kernels/lora.cu, module "lora"): shrink t = x A_s^T and expand
y += (t * scale_s) B_s^T, each row of a batch with its own adapter slot s (or none).

Rows reach the kernels as tiles (first row, rows, slot) of consecutive rows sharing a slot
(`build_tiles`): one row per tile for a decode step (its rows' adapters differ), up to eight
rows of one sequence's chunk for prefill. A row without an adapter gets no tile, so the
kernels never touch it; a step with no adapted row launches nothing. The arithmetic order
(the .cu header) is fixed per element: the twins below compute the same float32 operations
in the same order (numpy; the native library of gpu_runtime/native_lora.py where the host
backend runs native code, with the same bits), so kernel and twin agree bit for bit on the
emulator, and a row's bits never depend on its neighbours, its tile or the entry point.

Precision (chosen to stay close to HF + PEFT in float32): x A^T accumulates in float32 and
stays float32 (PEFT in a BF16 model rounds it to BF16), times the module's scaling in
float32, then B in float32, added to the base projection's BF16 output with one rounding.
On a GPU the kernels are built with fast math, so a subnormal float32 result there is
flushed to zero: within one rounding of the twin, never a different order.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from . import lora_native
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "lora"
LANES = 128            # the shrink's k lanes (chunks of 8 elements)
COLS = 8               # t columns per shrink CTA
MAX_C = 768            # parts * rp an expand takes (3 parts of rank 256)
TILE_ROWS = (1, 8)     # the entry points: one row per tile (decode), up to 8 (prefill)


def build_tiles(row_slots, max_rows: int) -> np.ndarray:
    """int32 [n_tiles, 3] (first row, rows, slot) covering every row whose slot is >= 0:
    runs of consecutive rows of one slot, cut at `max_rows` rows. Rows of slot < 0 get no
    tile."""
    slots = np.asarray(row_slots, np.int64)
    out = []
    i, m = 0, len(slots)
    while i < m:
        s = int(slots[i])
        j = i + 1
        while j < m and slots[j] == s and j - i < max_rows:
            j += 1
        if s >= 0:
            out.append((i, j - i, s))
        i = j
    return np.asarray(out, np.int32).reshape(-1, 3)


def _entry(kind: str, rows: int, vec: bool) -> str:
    if rows not in TILE_ROWS:
        raise InvalidArgument(f"lora_{kind}: rows_per_tile must be one of {TILE_ROWS}, got {rows}")
    return f"lora_{kind}_r{rows}_{'v8' if vec else 'v1'}"


def lora_shrink(backend, stream: int, t_ptr, x_ptr, a_pool, a_slot_stride: int, tiles_ptr,
                n_tiles: int, m: int, k: int, c: int, n_slots: int,
                rows_per_tile: int = 1) -> None:
    """t[i, :c] (float32, row stride c) = x[i, :k] (bf16 [m, k]) @ A_s^T for every row i of
    the `n_tiles` tiles at tiles_ptr (int32 [n_tiles, 3] on the device), A_s = a_pool +
    s * a_slot_stride (bf16 [c, k]). Rows outside the tiles are not written. No launch for
    n_tiles == 0."""
    check_sizes("lora_shrink", m=m, k=k, c=c, n_slots=n_slots, a_slot_stride=a_slot_stride)
    check_ptrs("lora_shrink", t_ptr=t_ptr, tiles_ptr=tiles_ptr, align=4)
    check_ptrs("lora_shrink", x_ptr=x_ptr, a_pool=a_pool, align=2)
    if int(n_tiles) < 0 or int(n_tiles) >= 2**31:
        raise InvalidArgument(f"lora_shrink: n_tiles must be in [0, 2^31), got {n_tiles}")
    if n_tiles == 0:
        return
    vec = k % 8 == 0 and a_slot_stride % 8 == 0 and int(x_ptr) % 16 == 0 and \
        int(a_pool) % 16 == 0
    func = _entry("shrink", rows_per_tile, vec)
    backend.launch(backend.kernel(MODULE, func), (int(n_tiles), -(-int(c) // COLS)), (LANES,),
                   0, stream, (DevicePtr(t_ptr), DevicePtr(x_ptr), DevicePtr(a_pool),
                               np.int64(a_slot_stride), DevicePtr(tiles_ptr), np.int32(m),
                               np.int32(k), np.int32(c), np.int32(n_slots)))


def lora_expand(backend, stream: int, y_ptr, t_ptr, b_pool, b_slot_stride: int, scale_pool,
                tiles_ptr, n_tiles: int, m: int, n: int, rp: int, part_ends, n_slots: int,
                rows_per_tile: int = 1, splits: int = 1, t_split_stride: int = 0) -> None:
    """y[i, j] (bf16 [m, n], in place) += (t[i, p*rp:(p+1)*rp] * scale_s[p]) . B_s[j, :rp]
    for every row i of the tiles; part p of the outputs is [part_ends[p-1], part_ends[p])
    (1 to 3 parts, the last ending at n); B_s = b_pool + s * b_slot_stride (bf16 [n, rp]),
    scale_s = scale_pool + s * parts (float32). t: float32 [m, parts * rp], or `splits`
    such arrays t_split_stride elements apart, added in order first (a tensor-parallel
    row-parallel projection's gathered partials)."""
    ends = [int(e) for e in part_ends]
    parts = len(ends)
    check_sizes("lora_expand", m=m, n=n, rp=rp, n_slots=n_slots, b_slot_stride=b_slot_stride,
                splits=splits)
    if splits > 1 and t_split_stride < m * parts * rp:
        raise InvalidArgument(f"lora_expand: t_split_stride {t_split_stride} is below one "
                              f"t of {m} x {parts * rp}")
    check_ptrs("lora_expand", t_ptr=t_ptr, scale_pool=scale_pool, tiles_ptr=tiles_ptr,
               align=4)
    check_ptrs("lora_expand", y_ptr=y_ptr, b_pool=b_pool, align=2)
    if not 1 <= parts <= 3 or ends[-1] != n or any(not 0 <= a <= b for a, b in
                                                   zip([0] + ends, ends)):
        raise InvalidArgument(f"lora_expand: part_ends {ends} must be 1 to 3 ascending ends, "
                              f"the last = n = {n}")
    c = parts * rp
    if c > MAX_C:
        raise InvalidArgument(f"lora_expand: parts * rp = {c} exceeds {MAX_C}")
    if int(n_tiles) < 0 or int(n_tiles) >= 2**31:
        raise InvalidArgument(f"lora_expand: n_tiles must be in [0, 2^31), got {n_tiles}")
    if n_tiles == 0:
        return
    p1, p2 = (ends + [n, n])[:2] if parts > 1 else (n, n)
    vec = rp % 8 == 0 and b_slot_stride % 8 == 0 and int(b_pool) % 16 == 0
    func = _entry("expand", rows_per_tile, vec)
    backend.launch(backend.kernel(MODULE, func), (int(n_tiles), -(-int(n) // LANES)),
                   (LANES,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(t_ptr), np.int64(t_split_stride),
                    np.int32(splits), DevicePtr(b_pool), np.int64(b_slot_stride),
                    DevicePtr(scale_pool), DevicePtr(tiles_ptr),
                    np.int32(m), np.int32(n), np.int32(rp), np.int32(c), np.int32(parts),
                    np.int32(p1), np.int32(p2), np.int32(n_slots)))


# ---------------------------------------------------------------------- the twins
def shrink_rows(x_bits: np.ndarray, a_bits: np.ndarray) -> np.ndarray:
    """float32 [r, c] = x_bits [r, k] @ a_bits [c, k]^T (BF16 bits) in the kernel's order:
    128 lanes of 8-element chunks, each lane's float32 sum in ascending k, then the halving
    tree."""
    r, k = x_bits.shape
    c = a_bits.shape[0]
    steps = -(-k // (LANES * 8))
    kp = steps * LANES * 8
    x = np.zeros((r, kp), np.float32)
    a = np.zeros((c, kp), np.float32)
    x[:, :k] = bf16_to_f32(x_bits)
    a[:, :k] = bf16_to_f32(a_bits)
    x4 = x.reshape(r, steps, LANES, 8)
    a4 = a.reshape(c, steps, LANES, 8)
    acc = np.zeros((r, c, LANES), np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for s in range(steps):
            for e in range(8):
                acc += x4[:, None, s, :, e] * a4[None, :, s, :, e]
        while acc.shape[-1] > 1:
            h = acc.shape[-1] // 2
            acc = acc[..., :h] + acc[..., h:]
    return acc[..., 0]


def expand_rows(y_bits: np.ndarray, t: np.ndarray, b_bits: np.ndarray, scale: np.ndarray,
                rp: int, ends: list[int]) -> np.ndarray:
    """BF16 bits [r, n]: y_bits + ((t * scale per part) @ B^T), the kernel's order."""
    b = bf16_to_f32(b_bits)
    delta = np.zeros(y_bits.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for p, (j0, j1) in enumerate(zip([0] + ends[:-1], ends)):
            u = t[:, p * rp:(p + 1) * rp] * np.float32(scale[p])
            for q in range(rp):
                delta[:, j0:j1] += u[:, q, None] * b[None, j0:j1, q]
        return f32_to_bf16(bf16_to_f32(y_bits) + delta)


def _tiles_by_slot(ctx, tiles_ptr, m: int, n_slots: int) -> dict[int, np.ndarray]:
    """slot -> the rows its tiles cover (ascending), as the kernels read the tiles."""
    tiles = ctx.read(tiles_ptr, 3 * int(ctx.grid[0]), np.int32).reshape(-1, 3)
    rows: dict[int, list] = {}
    for row0, count, slot in tiles.tolist():
        if slot < 0 or slot >= n_slots or row0 < 0 or count < 1 or row0 >= m:
            continue
        rows.setdefault(slot, []).extend(range(row0, min(row0 + count, m)))
    return {s: np.asarray(sorted(r), np.int64) for s, r in rows.items()}


def _shrink_twin(ctx, t_ptr, x_ptr, a_pool, a_slot_stride, tiles_ptr, m, k, c, n_slots):
    m, k, c, stride = int(m), int(k), int(c), int(a_slot_stride)
    if lora_native.shrink(ctx, t_ptr, x_ptr, a_pool, stride, tiles_ptr, m, k, c, int(n_slots)):
        return
    x = ctx.read(x_ptr, m * k, np.uint16).reshape(m, k)
    t = ctx.view(t_ptr, m * c, np.float32).reshape(m, c)
    for slot, rows in _tiles_by_slot(ctx, tiles_ptr, m, int(n_slots)).items():
        a = ctx.read(DevicePtr(a_pool).offset(2 * slot * stride), c * k, np.uint16)
        t[rows] = shrink_rows(x[rows], a.reshape(c, k))


def _expand_twin(ctx, y_ptr, t_ptr, t_split_stride, splits, b_pool, b_slot_stride,
                 scale_pool, tiles_ptr, m, n, rp, c, parts, part1, part2, n_slots):
    m, n, rp, c, parts = int(m), int(n), int(rp), int(c), int(parts)
    splits, tss = int(splits), int(t_split_stride)
    if lora_native.expand(ctx, y_ptr, t_ptr, tss, splits, b_pool, int(b_slot_stride),
                          scale_pool, tiles_ptr, m, n, rp, c, parts, int(part1), int(part2),
                          int(n_slots)):
        return
    ends = [int(part1), int(part2)][:parts - 1] + [n]   # part of j: (j >= p1) + (j >= p2)
    y = ctx.view(y_ptr, m * n, np.uint16).reshape(m, n)
    t = ctx.read(t_ptr, m * c, np.float32).reshape(m, c)
    for sp in range(1, splits):   # the ranks' partials, in order
        t = t + ctx.read(DevicePtr(t_ptr).offset(4 * sp * tss), m * c,
                         np.float32).reshape(m, c)
    for slot, rows in _tiles_by_slot(ctx, tiles_ptr, m, int(n_slots)).items():
        b = ctx.read(DevicePtr(b_pool).offset(2 * slot * int(b_slot_stride)), n * rp,
                     np.uint16).reshape(n, rp)
        scale = ctx.read(DevicePtr(scale_pool).offset(4 * slot * parts), parts, np.float32)
        y[rows] = expand_rows(y[rows], t[rows], b, scale, rp, ends)


def _register_twins() -> None:
    for rows in TILE_ROWS:
        for v in ("v8", "v1"):
            twin(MODULE, f"lora_shrink_r{rows}_{v}")(_shrink_twin)
            twin(MODULE, f"lora_expand_r{rows}_{v}")(_expand_twin)


_register_twins()
