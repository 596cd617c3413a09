"""HostBackend's native helpers: `native/*.cpp` compiled for this CPU on first use.

The GEMM twin's definition (metrale/ops/gemm_tc.py, `dot_f32`: 16 float32 lanes, a fixed
order that depends on k alone, subnormals flushed) computed with every core, reading the
BF16 weights as they are, through the CPU's BF16 dot-product instruction where it has one
and it passes a check at load against the formula (`uses_dp`), else through float32 FMAs:
the same bits as the numpy path either way (tests compare every pair), about a hundred
times faster;
and the BF16 <-> float32 conversions of the twins (`native/convert_bf16.cpp`, one pass
instead of numpy's seven for the rounding, exact either way); and the GGUF block formats
dequantized to BF16 at load (`native/dequant_gguf.cpp`, formats/gguf/quants.py's bits);
and the paged decode attention twin (`native/attention_f32.cpp`, ops/attention.py's split
structure, its float32 sums in a fixed order of its own).
The library is built with the C++ compiler of `cxx.py` for the machine it runs on
(`-march=native`) into `<cache_root()>/host/`, keyed by the source, the flags, the compiler
and the CPU, and reused by every later process. Without a compiler HostBackend runs the
numpy path.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import DeviceError, KernelError
from .cxx import build_host_library

log = logging.getLogger("metrale")

SOURCES = tuple(Path(__file__).resolve().parent / "native" / name
                for name in ("gemm_f32.cpp", "gemm_quant.cpp", "gemm_gguf.cpp", "convert_bf16.cpp",
                             "dequant_gguf.cpp", "norm_rope_act.cpp", "attention_f32.cpp"))
HEADERS = tuple(Path(__file__).resolve().parent / "native" / name
                for name in ("pool.h", "gemm_core.h", "gemm_avx2.h",
                             "gemm_quant_dp.h", "gemm_dp_view.h", "gemm_gguf_types.h",
                             "gemm_gguf_dp.h"))
# Adversarial blocks the load-time check runs through VDPBF16PS and the formula (~40 ms).
SELFCHECK_BLOCKS = 1 << 16
# IEEE arithmetic (no -ffast-math: signed zeros, NaN and subnormals are kept); FMA
# contraction is what the formula asks for (a_l + x w rounded once).
FLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
         "-ffp-contract=fast", "-fno-math-errno")
TUNE = ("-march=native",)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def _build(tune) -> Path:
    return build_host_library(SOURCES, (*FLAGS, *tune), "gemm_f32",
                              "the CPU backend's native library" + ("" if tune else
                                                                     " (generic build)"),
                              headers=HEADERS)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class NativeKernels:
    """The loaded library (see native/gemm_f32.cpp): `gemm(x_bits, w_bits, out)`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._f32, self._bf16 = lib.md_gemm_f32, lib.md_gemm_bf16
        for f in (self._f32, self._bf16):
            f.restype = None
            f.argtypes = [_P, _P, _I64, _I64, _I64, _P]
        self._q4, self._fp8 = lib.md_gemm_q4, lib.md_gemm_fp8
        self._q4.restype = self._fp8.restype = None
        self._q4.argtypes = [_P] * 6 + [_I64] * 5 + [_P, _P]
        self._fp8.argtypes = [_P] * 4 + [_I64] * 5 + [_P, _P]
        self._gguf_gemm = lib.md_gemm_gguf
        self._gguf_gemm.restype, self._gguf_gemm.argtypes = ctypes.c_int, [ctypes.c_int] + [
            _P] * 4 + [_I64] * 4 + [_P, _P]
        self._to_bf16, self._to_f32 = lib.md_f32_to_bf16, lib.md_bf16_to_f32
        for f in (self._to_bf16, self._to_f32):
            f.restype, f.argtypes = None, [_P, _P, _I64]
        self._gguf = lib.md_gguf_dequant_bf16
        self._gguf.restype = ctypes.c_int
        self._gguf.argtypes = [ctypes.c_int, _P, _P, _I64, ctypes.c_int]
        self._rmsnorm, self._rope, self._silu = (lib.md_rmsnorm, lib.md_rope_write_kv,
                                                 lib.md_silu_mul)
        self._rmsnorm.restype = self._rope.restype = self._silu.restype = None
        self._rmsnorm.argtypes = [_P] * 4 + [_I64] * 2 + [ctypes.c_float, ctypes.c_int32,
                                                           ctypes.c_float]
        self._rope.argtypes = [_P] * 8 + [_I64] * 4 + [ctypes.c_float]
        self._silu.argtypes = [_P, _P, _I64, _I64]
        self._add = lib.md_add_bf16
        self._add.restype, self._add.argtypes = None, [_P, _P, _I64]
        lib.md_sum_squares.restype, lib.md_sum_squares.argtypes = None, [_P, _I64, _I64, _P]
        self._attn_split, self._attn_combine = (lib.md_decode_attention_split,
                                                lib.md_decode_attention_combine)
        self._attn_split.restype = self._attn_combine.restype = ctypes.c_int
        self._attn_split.argtypes = [_P] * 7 + [_I64] * 7 + [ctypes.c_float] + [_I64] * 3
        self._attn_combine.argtypes = [_P] * 3 + [_I64] * 7
        lib.md_set_threads.argtypes = [ctypes.c_int]
        lib.md_set_threads(usable_cpus())
        lib.md_dp_selfcheck.restype, lib.md_dp_selfcheck.argtypes = _I64, [_I64]
        lib.md_set_dp.argtypes = [ctypes.c_int]
        lib.md_gemm_kind.restype = ctypes.c_char_p
        self._lib = lib
        # VDPBF16PS only where this CPU's instruction computes the formula, lane for lane
        self.dp_mismatches = lib.md_dp_selfcheck(SELFCHECK_BLOCKS) if lib.md_dp_compiled() \
            else -1
        self.set_dp(self.dp_mismatches == 0)
        # the norm and rope routines give the numpy twins' bits only if numpy sums a float32
        # row in the order they reproduce: checked here, else the twins stay in numpy
        self.row_twins = self._numpy_sum_order_holds()
        if not self.row_twins:
            log.warning("metrale: numpy's float32 sum order differs from the one "
                        "native/norm_rope_act.cpp reproduces; the norm and rope twins run "
                        "in numpy")
        if self.dp_mismatches > 0:
            log.warning("metrale: this CPU's VDPBF16PS differs from the GEMM formula in %d "
                        "of %d checked lanes; the native GEMM uses float32 FMAs instead",
                        self.dp_mismatches, 16 * SELFCHECK_BLOCKS)

    def _numpy_sum_order_holds(self) -> bool:
        rng = np.random.default_rng(0)
        for n in (1, 7, 8, 19, 64, 111, 128, 129, 576, 1000, 4097):
            x = (rng.standard_normal((3, n)) * [[1e-3], [1.0], [1e3]]).astype(np.float32)
            sums = np.empty(3, np.float32)
            self._lib.md_sum_squares(x.ctypes.data, 3, n, sums.ctypes.data)
            if not np.array_equal(sums.view(np.uint32),
                                  np.sum(x * x, axis=1, dtype=np.float32).view(np.uint32)):
                return False
        return True

    def set_dp(self, on: bool) -> bool:
        """Use the BF16 dot-product instruction (True, where built and checked) or the
        float32 steps: the same bits either way. Returns whether it is used now."""
        return bool(self._lib.md_set_dp(int(bool(on) and self.dp_mismatches == 0)))

    @property
    def kind(self) -> str:
        """The GEMM's step now: "vdpbf16ps", "fma" (float32 FMAs) or "float64"."""
        return self._lib.md_gemm_kind().decode()

    @property
    def uses_dp(self) -> bool:
        return self.kind == "vdpbf16ps"

    def gemm(self, x_bits: np.ndarray, w_bits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x_bits [m, k], w_bits [n, k] C-contiguous uint16 BF16; out [m, n] C-contiguous,
        float32 (gemm_tc.dot_f32 bit for bit) or uint16 (its BF16 rounding). Returns out."""
        m, k = x_bits.shape
        n = w_bits.shape[0]
        _check_rows("gemm", x_bits, w_bits)
        if out.shape != (m, n) or not out.flags.c_contiguous or \
                out.dtype not in (np.float32, np.uint16):
            raise ValueError(f"gemm: out must be C-contiguous float32 or uint16 [{m}, {n}]")
        f = self._f32 if out.dtype == np.float32 else self._bf16
        f(x_bits.ctypes.data, w_bits.ctypes.data, m, n, k, out.ctypes.data)
        return out

    def gemm_at(self, x_addr: int, w_addr: int, m: int, n: int, k: int, out_addr: int,
                out_fp32: bool) -> None:
        """gemm on checked addresses, as gemm_q4_at: x [m, k] and W [n, k] uint16 BF16 bits,
        out [m, n] float32 or BF16 bits, C-contiguous."""
        (self._f32 if out_fp32 else self._bf16)(x_addr, w_addr, m, n, k, out_addr)

    def gemm_q4(self, x_bits, q, scales, zeros, gidx, gidx_row, k: int, group_size: int,
                out: np.ndarray) -> np.ndarray:
        """x_bits [m, k] uint16; q uint32 [n, ceil(k / 32) * 4]; scales uint16 FP16 bits and
        zeros uint8 [n, groups]; act-order gidx int32 [parts, k] with gidx_row int32 [n], or
        None, None: out [m, n] (float32 or BF16 bits) = ops.gemm_q's twin bit for bit, W
        read packed. Returns out."""
        m, n = len(x_bits), len(q)
        _check_out("gemm_q4", out, m, n)
        arrs = [np.ascontiguousarray(a) for a in (x_bits, q, scales, zeros)]
        if arrs[0].shape != (m, k) or arrs[1].nbytes != n * ((k + 31) // 32 * 16) or \
                arrs[2].shape != arrs[3].shape or arrs[2].shape[0] != n:
            raise ValueError("gemm_q4: x_bits [m, k], q [n, ceil(k / 32) * 4], scales and "
                             "zeros [n, groups]")
        g = gr = None
        if gidx is not None:
            g = np.ascontiguousarray(gidx, np.int32).reshape(-1, k)
            gr = np.ascontiguousarray(gidx_row, np.int32)
            if gr.shape != (n,) or gr.min() < 0 or gr.max() >= len(g) or g.min() < 0 or \
                    g.max() >= arrs[2].shape[1]:
                raise ValueError("gemm_q4: gidx_row [n] indexes gidx [parts, k] whose groups "
                                 "are < groups")
        f32, bf = (out, None) if out.dtype == np.float32 else (None, out)
        self._q4(*(a.ctypes.data for a in arrs), None if g is None else g.ctypes.data,
                 None if gr is None else gr.ctypes.data, m, n, k, arrs[2].shape[1],
                 int(group_size),
                 None if f32 is None else f32.ctypes.data, None if bf is None else bf.ctypes.data)
        return out

    def gemm_q4_at(self, x_addr: int, q_addr: int, scales_addr: int, zeros_addr: int,
                   m: int, n: int, k: int, groups: int, group_size: int, out_addr: int,
                   out_fp32: bool) -> None:
        """gemm_q4 without act-order, on addresses whose ranges the caller has checked (the
        HostBackend twins: read_addr / write_addr): x [m, k] uint16, q [n, ceil(k / 32) *
        16] bytes, scales uint16 and zeros uint8 [n, groups], out [m, n] float32 or BF16
        bits, C-contiguous. Same bits as gemm_q4; no numpy views and no ctypes objects (a
        decode step makes ~100 of these calls; gemm_q4's copies and checks cost several
        microseconds each)."""
        self._q4(x_addr, q_addr, scales_addr, zeros_addr, None, None, m, n, k, groups,
                 group_size, out_addr if out_fp32 else None, None if out_fp32 else out_addr)

    def gemm_fp8_at(self, x_addr: int, q_addr: int, scales_addr: int, scale_row_addr: int,
                    m: int, n: int, k: int, k_blocks: int, block_k: int, out_addr: int,
                    out_fp32: bool) -> None:
        """gemm_fp8 on checked addresses, as gemm_q4_at: x [m, k] uint16, q [n, ceil(k /
        32) * 32] bytes, scales float32 [rows, k_blocks], scale_row int32 [n] whose values
        the caller has checked to be < rows, out [m, n] float32 or BF16 bits."""
        self._fp8(x_addr, q_addr, scales_addr, scale_row_addr, m, n, k, k_blocks, block_k,
                  out_addr if out_fp32 else None, None if out_fp32 else out_addr)

    def gemm_fp8(self, x_bits, q, scales, scale_row, k: int, block_k: int,
                 out: np.ndarray) -> np.ndarray:
        """x_bits [m, k] uint16; q uint8 [n, ceil(k / 32) * 32]; scales float32 [rows,
        k_blocks]; scale_row int32 [n]: out [m, n] = ops.gemm_q's FP8 twin bit for bit."""
        m, n = len(x_bits), len(q)
        _check_out("gemm_fp8", out, m, n)
        arrs = [np.ascontiguousarray(a) for a in (x_bits, q, scales, scale_row)]
        if arrs[0].shape != (m, k) or arrs[1].shape != (n, (k + 31) // 32 * 32) or \
                arrs[2].dtype != np.float32 or arrs[3].shape != (n,) or \
                arrs[2].shape[1] != -(-k // block_k) or arrs[3].max() >= len(arrs[2]):
            raise ValueError("gemm_fp8: x_bits [m, k], q [n, ceil(k / 32) * 32], scales "
                             "float32 [rows, ceil(k / block_k)], scale_row [n] < rows")
        f32, bf = (out, None) if out.dtype == np.float32 else (None, out)
        self._fp8(*(a.ctypes.data for a in arrs), m, n, k, arrs[2].shape[1], int(block_k),
                  None if f32 is None else f32.ctypes.data, None if bf is None else bf.ctypes.data)
        return out

    def gemm_gguf_at(self, ggml_type: int, x_addr: int, q_addr: int, qh_addr: int,
                     meta_addr: int, m: int, n: int, k: int, ldy: int, out_addr: int,
                     out_fp32: bool) -> bool:
        """ops.gemm_gguf's twin bit for bit on checked addresses (as gemm_q4_at), out rows
        ldy apart; qh 0 without one. False, nothing written, for a type not kept packed."""
        return self._gguf_gemm(ggml_type, x_addr, q_addr, qh_addr or None, meta_addr, m, n, k,
                               ldy, out_addr if out_fp32 else None,
                               None if out_fp32 else out_addr) == 0

    def f32_to_bf16(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x C-contiguous float32, out C-contiguous uint16 of x's size: ops.bf16's rule."""
        _check_pair("f32_to_bf16", x, np.float32, out, np.uint16)
        self._to_bf16(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def bf16_to_f32(self, bits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """bits C-contiguous uint16, out C-contiguous float32 of its size: exact widening."""
        _check_pair("bf16_to_f32", bits, np.uint16, out, np.float32)
        self._to_f32(bits.ctypes.data, out.ctypes.data, bits.size)
        return out

    def rmsnorm(self, out_ptr: int, x_ptr: int, weight_ptr: int, residual_ptr: int,
                n_rows: int, hidden: int, eps: float, mode: int = 0,
                offset: float = 0.0) -> None:
        """ops.rmsnorm's twin bit for bit on host addresses the caller has bounds-checked:
        x, out, residual (0: none) [n_rows, hidden] BF16; weight [hidden] BF16. out may
        equal x; no other overlap. mode 0: bf16(bf16(x * inv) * w); 1: bf16(x * inv * w);
        2: bf16(x * inv * (w + offset)) (norm_rope_act.cpp)."""
        self._rmsnorm(out_ptr, x_ptr, weight_ptr, residual_ptr or None, n_rows, hidden,
                      eps, int(mode), float(offset))

    def rope_write_kv(self, qkv_ptr: int, positions_ptr: int, table_ptr: int,
                      q_norm_ptr: int, k_norm_ptr: int, k_cache_ptr: int, v_cache_ptr: int,
                      slot_mapping_ptr: int, n_tokens: int, num_heads: int,
                      num_kv_heads: int, head_dim: int, norm_eps: float) -> None:
        """ops.rope's apply_rope (k_cache_ptr 0) / rope_write_kv twin bit for bit, on
        checked host addresses: qkv BF16 [n_tokens, heads + 2 kv_heads, head_dim] in place,
        positions int32 [n_tokens] inside the float32 table, norms BF16 [head_dim] or 0,
        caches BF16 [slots, kv_heads * head_dim] with slot_mapping int32 inside them."""
        self._rope(qkv_ptr, positions_ptr, table_ptr, q_norm_ptr or None, k_norm_ptr or None,
                   k_cache_ptr or None, v_cache_ptr or None, slot_mapping_ptr or None,
                   n_tokens, num_heads, num_kv_heads, head_dim, norm_eps)

    def silu_mul(self, out_ptr: int, gate_up_ptr: int, n_rows: int,
                 intermediate: int) -> None:
        """out BF16 [n_rows, I] = bf16(silu(g) * u), gate_up BF16 [n_rows, 2 I] (checked
        host addresses, no overlap): ops.activation's twin but for exp, which is the C
        library's here (numpy's SIMD exp differs by up to 2 float32 ulps)."""
        self._silu(out_ptr, gate_up_ptr, n_rows, intermediate)

    def add_bf16(self, residual_ptr: int, y_ptr: int, count: int) -> None:
        """residual = bf16(residual + y) on `count` BF16 values at checked host addresses,
        no overlap: rmsnorm's residual add, bit for bit (one float32 add, RNE)."""
        self._add(residual_ptr, y_ptr, count)

    def gguf_dequant_bf16(self, ggml_type: int, raw: np.ndarray, out: np.ndarray) -> bool:
        """raw: a tensor's stored GGUF bytes (uint8, C-contiguous), out: C-contiguous uint16
        of its element count; False (out untouched) for a type the library lacks."""
        if not (raw.dtype == np.uint8 and raw.flags.c_contiguous and out.dtype == np.uint16
                and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("gguf_dequant_bf16: C-contiguous uint8 in, writable "
                             "C-contiguous uint16 out")
        return self._gguf(int(ggml_type), raw.ctypes.data, out.ctypes.data, out.size,
                          usable_cpus()) == 0

    def decode_attention_split(self, out_ptr, workspace_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                               block_tables_ptr, kv_lens_ptr, n_seqs: int, num_heads: int,
                               num_kv_heads: int, head_dim: int, block_size: int,
                               max_blocks_per_seq: int, max_splits: int, scale: float,
                               sliding_window: int, k_blocks: int, v_blocks: int) -> bool:
        """ops/attention.py's decode split twin (native/attention_f32.cpp), its arguments
        as host addresses the caller has bounds-checked (out [n_seqs, H*D], workspace when
        max_splits > 1, qkv's query rows, block_tables, kv_lens); the caches hold k_blocks
        and v_blocks blocks. False, with nothing written, where the twin raises (a length
        over the capacity, a table entry < 0 or past the cache): its numpy path says why."""
        return self._attn_split(int(out_ptr), int(workspace_ptr), int(qkv_ptr),
                                int(k_cache_ptr), int(v_cache_ptr), int(block_tables_ptr),
                                int(kv_lens_ptr), int(n_seqs), int(num_heads),
                                int(num_kv_heads), int(head_dim), int(block_size),
                                int(max_blocks_per_seq), int(max_splits), float(scale),
                                int(sliding_window), int(k_blocks), int(v_blocks)) == 0

    def decode_attention_combine(self, out_ptr, workspace_ptr, kv_lens_ptr, n_seqs: int,
                                 num_heads: int, head_dim: int, block_size: int,
                                 max_blocks_per_seq: int, max_splits: int,
                                 sliding_window: int) -> bool:
        """ops/attention.py's decode_attention_combine_twin (native/attention_f32.cpp),
        over bounds-checked host addresses as above. False, with nothing written, where
        the twin raises."""
        return self._attn_combine(int(out_ptr), int(workspace_ptr), int(kv_lens_ptr),
                                  int(n_seqs), int(num_heads), int(head_dim), int(block_size),
                                  int(max_blocks_per_seq), int(max_splits),
                                  int(sliding_window)) == 0


def _check_out(what: str, out, m: int, n: int) -> None:
    if out.shape != (m, n) or not out.flags.c_contiguous or not out.flags.writeable or \
            out.dtype not in (np.float32, np.uint16):
        raise ValueError(f"{what}: out must be writable C-contiguous float32 or uint16 "
                         f"[{m}, {n}]")


def _check_pair(what: str, x, x_dtype, out, out_dtype) -> None:
    if not (x.dtype == x_dtype and out.dtype == out_dtype and x.flags.c_contiguous and
            out.flags.c_contiguous and out.flags.writeable and x.size == out.size):
        raise ValueError(f"{what}: C-contiguous {np.dtype(x_dtype)} in, writable "
                         f"C-contiguous {np.dtype(out_dtype)} out of the same size")


def _check_rows(what: str, x_bits, w_bits) -> None:
    if not (x_bits.flags.c_contiguous and w_bits.flags.c_contiguous and x_bits.ndim == 2 and
            w_bits.ndim == 2 and x_bits.dtype == w_bits.dtype == np.uint16 and
            w_bits.shape[1] == x_bits.shape[1]):
        raise ValueError(f"{what}: x_bits [m, k] and w_bits [n, k] must be C-contiguous "
                         "uint16")


@lru_cache(maxsize=1)
def load() -> NativeKernels:
    """Build (or find in the cache) and load the library; KernelError / DeviceError when
    this machine cannot (no compiler, or the build fails with and without -march=native)."""
    try:
        return NativeKernels(_build(TUNE))
    except KernelError as e:   # a compiler without -march=native (or a source that fails
        # only with this CPU's instruction sets: said, as the generic build is much slower)
        log.warning("metrale: the native library's build for this CPU failed, using the "
                    "generic build: %s", str(e).splitlines()[-1])
        return NativeKernels(_build(()))


@lru_cache(maxsize=1)
def try_load() -> NativeKernels | None:
    """`load()`, or None (said once, in the log) when this machine cannot build it."""
    try:
        return load()
    except (KernelError, DeviceError, OSError) as e:
        log.info("metrale: the CPU backend's native GEMM library is unavailable (%s); "
                 "its GEMMs run in numpy, slower, with the same results",
                 str(e).splitlines()[0])
        return None
