#!/usr/bin/env python3
"""Every kernel family of metrale/ops at real model sizes, against the device's peak.

    python benchmarks/bench_kernels.py [--device auto|cpu|cuda:N] [--small] [--json FILE]

Shapes are Llama-3.1-8B's (hidden 4096, intermediate 14336, 32 heads / 8 kv heads x 128,
vocab 128256; 2048-token prefill chunks; decode batches 1, 8, 64 at 4096 cached tokens),
Whisper-small's conv stem and a CLIP ViT-L/14-336 patch embed; the MoE kernels at
Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, expert width 768); the hybrid models'
recurrent layers at Qwen3.5-0.8B's gated DeltaNet (16 key / 16 value heads x 128, conv over
6144 channels) and Nemotron-H-8B's Mamba2 mixer (128 heads x 64, d_state 128, 8 groups,
chunk 128, conv over 10240 channels); the grouped LoRA GEMMs at the 8B's fused groups with
4 adapters of rank 16. Every linear shape (qkv, o,
gate_up, down, lm_head) runs through the tensor-core GEMM the model uses (`gemm_tc`, its
tile in the shape) and cuBLAS at m = 1, 8, 64, 2048, and the CUDA-core GEMV at 1, 8, 64; the
dequantizing GEMM (`gemm_q`: 4-bit and FP8 weights) and the GEMM over GGUF weights at their
bytes (`gemm_gguf`: Q4_K, Q6_K, Q8_0, Q4_0) at the same shapes and rows.
`--small` shrinks every shape so the whole run takes seconds on the CPU (HostBackend runs
the numpy twins; the numbers then only show that every launcher still runs).

Each record has the median time of one launch (events around `--inner` back-to-back
launches, `--reps` times, after warm-up), the bytes it must move and the FLOPs it must do,
achieved GB/s and TFLOP/s, and `fraction_of_peak` against the peaks measured in the same
run: GB/s / the device-to-device copy bandwidth for memory-bound kernels, TFLOP/s / the
cuBLAS BF16 GEMM (8192^3, `backend.gemm_bf16`) for compute-bound ones. Buffers hold
memset patterns (small normal BF16/FP32 values) and valid indices; values do not change
the work of these kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import pkgutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.bench import roofline  # noqa: E402
from metrale.bench.env import environment  # noqa: E402
from metrale.gpu_runtime import backend as pick_backend  # noqa: E402

FULL = dict(hidden=4096, inter=14336, H=32, KV=8, D=128, vocab=128256, tokens=2048,
            rows=(1, 8, 64), kv_len=4096, block=16, mel=80, d_model=768, frames=3000,
            image=336, patch=14, vit_hidden=1024, cast_n=1 << 26, enc_len=1500, enc_heads=12,
            moe=(128, 8, 2048, 768),   # experts, top-k, hidden, expert width: Qwen3-30B-A3B
            gdn=(16, 16, 128, 128),    # key heads, value heads, d_k, d_v: Qwen3.5-0.8B
            ssd=(128, 8, 64, 128, 128),   # heads, groups, head_dim, d_state, chunk: Nemotron-H-8B
            # heads, kv_lora_rank, rope, nope, v dims: DeepSeek-V3's MLA; its router
            mla=(128, 512, 64, 128, 128), ds_router=(256, 8, 8, 4))
SMALL = dict(hidden=256, inter=512, H=4, KV=2, D=64, vocab=2048, tokens=64, rows=(1, 4),
             kv_len=256, block=16, mel=16, d_model=64, frames=64, image=56, patch=14,
             vit_hidden=64, cast_n=1 << 14, enc_len=64, enc_heads=4, moe=(16, 4, 256, 128),
             gdn=(2, 4, 32, 32), ssd=(4, 2, 32, 64, 32), mla=(4, 64, 16, 32, 32),
             ds_router=(16, 4, 4, 2))


class Bench:
    def __init__(self, be, reps: int, warmup: int, inner: int) -> None:
        self.be, self.reps, self.warmup, self.inner = be, reps, warmup, inner
        self.bufs: list = []
        self.results: list[dict] = []
        self.copy_gb_s = roofline.copy_bandwidth(be)
        self.gemm_tflops = roofline.gemm_peak_tflops(be)

    # buffers --------------------------------------------------------------------------
    def buf(self, nbytes: int, fill: int = 0x3C):
        """A device buffer memset to `fill` (0x3C: BF16 0x3C3C and FP32 0x3C3C3C3C are
        small normal numbers)."""
        p = self.be.alloc(int(nbytes))
        self.bufs.append(p)
        s = self.be.default_stream()  # the kernels' stream (CUDA: a non-blocking one)
        self.be.memset_async(p, fill, int(nbytes), s)
        self.be.synchronize(s)
        return p

    def upload(self, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        p = self.be.alloc(arr.nbytes)
        self.bufs.append(p)
        self.be.copy_h2d(arr, p)
        return p

    def free_all(self) -> None:
        self.be.synchronize(self.be.default_stream())
        for p in self.bufs:
            self.be.free(p)
        self.bufs = []

    # timing ---------------------------------------------------------------------------
    def run(self, family: str, kernel: str, shape: dict, fn, nbytes: int = 0,
            flops: int = 0, bound: str = "memory") -> None:
        be, s = self.be, self.be.default_stream()
        rec = {"family": family, "kernel": kernel, "shape": shape, "bound": bound,
               "bytes": int(nbytes), "flops": int(flops)}
        try:
            for _ in range(self.warmup):
                fn(s)
            be.synchronize(s)
            start, end = be.create_event(), be.create_event()
            times = []
            for _ in range(self.reps):
                be.record_event(start, s)
                for _ in range(self.inner):
                    fn(s)
                be.record_event(end, s)
                be.event_synchronize(end)
                times.append(be.event_elapsed_ms(start, end) / self.inner)
            for e in (start, end):
                getattr(be, "destroy_event", lambda _e: None)(e)
            t = statistics.median(times) / 1e3
            rec["time_us"] = t * 1e6
            rec["gb_s"] = nbytes / t / 1e9 if nbytes and t > 0 else None
            rec["tflop_s"] = flops / t / 1e12 if flops and t > 0 else None
            peak = self.copy_gb_s if bound == "memory" else self.gemm_tflops
            got = rec["gb_s"] if bound == "memory" else rec["tflop_s"]
            rec["fraction_of_peak"] = got / peak if got and peak else None
        except Exception as e:  # one kernel failing must not stop the others
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc(limit=4)
        self.results.append(rec)


# the families ------------------------------------------------------------------------------
def bench_embedding(B, S):
    from metrale.ops import embedding
    T, hid, V = S["tokens"], S["hidden"], S["vocab"]
    table, out = B.buf(V * hid * 2), B.buf(T * hid * 2)
    ids = B.upload(np.random.default_rng(0).integers(0, V, T).astype(np.int32))
    B.run("embedding", "embedding", dict(n_tokens=T, hidden=hid, vocab=V),
          lambda s: embedding.embedding(B.be, s, out, table, ids, T, hid, V),
          nbytes=2 * T * hid * 2 + T * 4)


def bench_rmsnorm(B, S):
    from metrale.ops import rmsnorm
    T, hid = S["tokens"], S["hidden"]
    x, out, res, w, bias = (B.buf(T * hid * 2), B.buf(T * hid * 2), B.buf(T * hid * 2),
                            B.buf(hid * 2), B.buf(hid * 2))
    B.run("rmsnorm", "rmsnorm", dict(n_rows=T, hidden=hid),
          lambda s: rmsnorm.rmsnorm(B.be, s, out, x, w, T, hid, 1e-5), nbytes=2 * T * hid * 2)
    B.run("rmsnorm", "rmsnorm+residual", dict(n_rows=T, hidden=hid),
          lambda s: rmsnorm.rmsnorm(B.be, s, out, x, w, T, hid, 1e-5, residual_ptr=res),
          nbytes=4 * T * hid * 2)
    # Gemma's (1 + w) and gpt-oss's one-rounding weight modes (issue 40)
    for mode in ("gemma", "once"):
        B.run("rmsnorm", f"rmsnorm {mode}", dict(n_rows=T, hidden=hid),
              lambda s, mode=mode: rmsnorm.rmsnorm(B.be, s, out, x, w, T, hid, 1e-5,
                                                   weight_mode=mode),
              nbytes=2 * T * hid * 2)
    B.run("rmsnorm", "layernorm", dict(n_rows=T, hidden=hid),
          lambda s: rmsnorm.layernorm(B.be, s, out, x, w, bias, T, hid, 1e-5),
          nbytes=2 * T * hid * 2)


def bench_activation(B, S):
    from metrale.ops import activation
    T, I = S["tokens"], S["inter"]
    gu, out = B.buf(T * 2 * I * 2), B.buf(T * I * 2)
    B.run("activation", "act_mul", dict(n_rows=T, intermediate=I),
          lambda s: activation.act_mul(B.be, s, out, gu, T, I), nbytes=3 * T * I * 2)
    B.run("activation", "act_mul swiglu_clamp", dict(n_rows=T, intermediate=I),
          lambda s: activation.act_mul(B.be, s, out, gu, T, I, "swiglu_clamp", 1.702, 7.0),
          nbytes=3 * T * I * 2)
    n = T * I
    B.run("activation", "gelu", dict(n=n),
          lambda s: activation.gelu(B.be, s, out, out, n, "none"), nbytes=2 * n * 2)


def bench_cast(B, S):
    from metrale.ops import cast
    n = S["cast_n"]
    b16, f32 = B.buf(n * 2), B.buf(n * 4)
    B.run("cast", "bf16_to_f32", dict(n=n), lambda s: cast.bf16_to_f32(B.be, s, f32, b16, n),
          nbytes=6 * n)
    B.run("cast", "f32_to_bf16", dict(n=n), lambda s: cast.f32_to_bf16(B.be, s, b16, f32, n),
          nbytes=6 * n)


def bench_elementwise(B, S):
    from metrale.ops import elementwise
    T, hid, qkv = S["tokens"], S["hidden"], (S["H"] + 2 * S["KV"]) * S["D"]
    x, bias = B.buf(T * qkv * 2), B.buf(qkv * 2)
    B.run("elementwise", "add_bias", dict(n_rows=T, width=qkv),
          lambda s: elementwise.add_bias(B.be, s, x, bias, T, qkv), nbytes=2 * T * qkv * 2)
    a, b = B.buf(T * hid * 2), B.buf(T * hid * 2)
    n = T * hid
    B.run("elementwise", "add_inplace", dict(n=n),
          lambda s: elementwise.add_inplace(B.be, s, a, b, n), nbytes=3 * n * 2)
    # Gemma: the embedding normalizer over a prefill's rows, the final logit cap over a
    # decode batch's logits (BF16 and FP32)
    B.run("elementwise", "scale_inplace", dict(n=n),
          lambda s: elementwise.scale_inplace(B.be, s, a, 48.0, n), nbytes=2 * n * 2)
    R, V = S["rows"][-1], S["vocab"]
    logits = B.buf(R * V * 4)
    for fp32 in (False, True):
        B.run("elementwise", f"softcap_inplace {'fp32' if fp32 else 'bf16'}", dict(n=R * V),
              lambda s, fp32=fp32: elementwise.softcap_inplace(B.be, s, logits, 30.0, R * V,
                                                               fp32),
              nbytes=2 * R * V * (4 if fp32 else 2))


def bench_tensor_parallel(B, S):
    """The combines of a TP=8 rank at the preset's shapes: the rank-order sum of 8 partials of a
    decode batch and of a prefill chunk, the logits-shard concat, the vocabulary-shard
    embedding."""
    from metrale.ops import tensor_parallel as tp
    R, hid, V = 8, S["hidden"], S["vocab"]
    for rows in (S["rows"][-1], S["tokens"]):
        n = rows * hid
        parts, out = B.buf(R * n * 4), B.buf(n * 2)
        B.run("tensor_parallel", "tp_sum_partials", dict(count=n, n_ranks=R),
              lambda s, o=out, p=parts, n=n: tp.tp_sum_partials(B.be, s, o, p, n, R),
              nbytes=R * n * 4 + n * 2)
    rows, vs = S["rows"][-1], -(-V // R)
    shards, logits = B.buf(R * rows * vs * 2), B.buf(rows * V * 2)
    B.run("tensor_parallel", "tp_concat_shards", dict(n_rows=rows, vocab=V, n_ranks=R),
          lambda s: tp.tp_concat_shards(B.be, s, logits, shards, rows, V * 2, vs * 2, R),
          nbytes=2 * rows * V * 2)
    T = S["tokens"]
    table, out = B.buf(vs * hid * 2), B.buf(T * hid * 4)
    ids = B.upload(np.random.default_rng(0).integers(0, V, T).astype(np.int32))
    B.run("tensor_parallel", "tp_embedding_shard", dict(n_tokens=T, hidden=hid, shard_rows=vs),
          lambda s: tp.tp_embedding_shard(B.be, s, out, table, ids, T, hid, 0, vs),
          nbytes=T * hid * 4 + T * hid * 2 // R + T * 4)


def linear_shapes(S) -> list[tuple[str, int, int]]:
    """(name, n, k) of every linear layer of the preset and its lm_head."""
    qkv = (S["H"] + 2 * S["KV"]) * S["D"]
    return [("qkv_proj", qkv, S["hidden"]), ("o_proj", S["hidden"], S["H"] * S["D"]),
            ("gate_up_proj", 2 * S["inter"], S["hidden"]), ("down_proj", S["hidden"], S["inter"]),
            ("lm_head", S["vocab"], S["hidden"])]


def bench_linears(B, S, family: str, rows, fn, fp32_fn=None) -> None:
    """`fn(s, y, x, w, m, n, k)` for every linear shape and row count m in `rows`; compute-
    bound from 256 rows up. `fp32_fn` (FP32 logits): lm_head at the largest decode batch."""
    x = B.buf(max(rows) * max(S["hidden"], S["inter"]) * 2)
    y = B.buf(max(rows) * max(2 * S["inter"], S["vocab"]) * 2
              + max(S["rows"]) * S["vocab"] * 4)
    for name, n, k in linear_shapes(S):
        w = B.buf(n * k * 2)
        for m in rows:
            B.run(family, f"{family}_bf16 {name}", dict(m=m, n=n, k=k),
                  lambda s, w=w, m=m, n=n, k=k: fn(s, y, x, w, m, n, k),
                  nbytes=(n * k + m * k + m * n) * 2, flops=2 * m * n * k,
                  bound="compute" if m >= 256 else "memory")
        if name == "lm_head" and fp32_fn is not None:
            m = max(S["rows"])
            B.run(family, f"{family}_fp32 {name}", dict(m=m, n=n, k=k),
                  lambda s, w=w, m=m, n=n, k=k: fp32_fn(s, y, x, w, m, n, k),
                  nbytes=(n * k + m * k) * 2 + m * n * 4, flops=2 * m * n * k)
        B.be.free(w)
        B.bufs.remove(w)


def bench_gemv(B, S):
    """The CUDA-core GEMV (decode sizes only): the reference the tensor-core GEMM replaced."""
    from metrale.ops import gemm
    bench_linears(B, S, "gemv", S["rows"],
                  lambda s, y, x, w, m, n, k: gemm.gemv(B.be, s, y, x, w, m, n, k),
                  lambda s, y, x, w, m, n, k: gemm.gemv(B.be, s, y, x, w, m, n, k,
                                                         out_fp32=True))


def bench_gemm(B, S):
    """cuBLAS (`backend.gemm_bf16`), the measured reference, at decode and prefill rows."""
    from metrale.ops import gemm
    bench_linears(B, S, "gemm", (*S["rows"], S["tokens"]),
                  lambda s, y, x, w, m, n, k: gemm.gemm(B.be, s, y, x, w, m, n, k))


def bench_gemm_tc(B, S):
    """The batch-invariant tensor-core GEMM the model runs, at the same shapes and rows."""
    from metrale.ops import gemm_tc
    bench_linears(B, S, "gemm_tc", (*S["rows"], S["tokens"]),
                  lambda s, y, x, w, m, n, k: gemm_tc.gemm_tc(B.be, s, y, x, w, m, n, k),
                  lambda s, y, x, w, m, n, k: gemm_tc.gemm_tc(B.be, s, y, x, w, m, n, k,
                                                               out_fp32=True))
    for r in B.results:
        if r["family"] == "gemm_tc" and "shape" in r:
            r["shape"]["tile"] = gemm_tc.pick_tile(r["shape"]["m"], r["shape"]["n"]).name


def bench_gemm_fused(B, S):
    """The decode GEMMs with rmsnorm / act_mul / the residual add fused in, at the decode row
    counts: qkv and gate_up with the norm, o_proj with the residual add, down_proj with
    act_mul and the residual add (compare with gemm_tc's rows of the same shapes)."""
    from metrale.ops import gemm_fused
    hid, inter = S["hidden"], S["inter"]
    qkv = (S["H"] + 2 * S["KV"]) * S["D"]
    rows = [m for m in S["rows"] if m <= 16]
    mx = max(rows)
    res, x = B.buf(mx * hid * 2, fill=0), B.buf(mx * max(hid, 2 * inter) * 2)
    y, nw = B.buf(mx * max(qkv, 2 * inter) * 2), B.buf(hid * 2)
    for name, n, k, kind in (("qkv_proj", qkv, hid, "rmsnorm"),
                             ("o_proj", hid, S["H"] * S["D"], "residual"),
                             ("gate_up_proj", 2 * inter, hid, "rmsnorm"),
                             ("down_proj", hid, inter, "actmul_residual")):
        w = B.buf(n * k * 2)
        for m in rows:
            if kind == "rmsnorm":
                fn = (lambda s, w=w, m=m, n=n, k=k: gemm_fused.gemm_rmsnorm(
                    B.be, s, y, res, w, nw, m, n, k, 1e-5))
            elif kind == "residual":
                fn = (lambda s, w=w, m=m, n=n, k=k: gemm_fused.gemm_residual(
                    B.be, s, res, x, w, m, n, k))
            else:
                fn = (lambda s, w=w, m=m, n=n, k=k: gemm_fused.gemm_actmul_residual(
                    B.be, s, res, x, w, m, n, k))
            in_k = 2 * k if kind == "actmul_residual" else k
            B.run("gemm_fused", f"gemm_{kind} {name}", dict(m=m, n=n, k=k),
                  fn, nbytes=(n * k + m * in_k + m * n) * 2, flops=2 * m * n * k)
        B.be.free(w)
        B.bufs.remove(w)


def bench_gemm_q(B, S):
    """The dequantizing GEMM (4-bit groups of 128, FP8 128x128 blocks) at the same shapes and
    rows: bytes are the packed W + scales (+ zeros) the kernel must read, so decode rows
    compare with gemm_tc's against the copy bandwidth."""
    from metrale.ops import gemm_q, gemm_tc
    rows = (*S["rows"], S["tokens"])
    x = B.buf(max(rows) * max(S["hidden"], S["inter"]) * 2)
    y = B.buf(max(rows) * max(2 * S["inter"], S["vocab"]) * 4)
    for name, n, k in linear_shapes(S):
        g, kb = -(-k // 128), -(-k // 128)
        q4 = [B.buf(n * gemm_q.q4_row_bytes(k), 0x5A), B.buf(n * g * 2, 0x1C),
              B.buf(n * g, 0x08)]
        f8 = [B.buf(n * gemm_q.fp8_row_bytes(k), 0x3A), B.buf(-(-n // 128) * kb * 4, 0x3A),
              B.upload((np.arange(n) // 128).astype(np.int32))]
        q4_bytes = n * gemm_q.q4_row_bytes(k) + n * g * 3
        f8_bytes = n * gemm_q.fp8_row_bytes(k) + -(-n // 128) * kb * 4 + n * 4
        for m in rows:
            shape = dict(m=m, n=n, k=k, tile=gemm_tc.pick_tile(m, n).name)
            bound = "compute" if m >= 256 else "memory"
            B.run("gemm_q", f"gemm_q4_bf16 {name}", dict(shape, group_size=128),
                  lambda s, m=m, n=n, k=k, w=q4: gemm_q.gemm_q4(
                      B.be, s, y, x, w[0], w[1], w[2], 0, 0, m, n, k, -(-k // 128), 128),
                  nbytes=q4_bytes + (m * k + m * n) * 2, flops=2 * m * n * k, bound=bound)
            B.run("gemm_q", f"gemm_fp8_bf16 {name}", dict(shape, block=[128, 128]),
                  lambda s, m=m, n=n, k=k, w=f8: gemm_q.gemm_fp8(
                      B.be, s, y, x, w[0], w[1], w[2], m, n, k, -(-k // 128), 128),
                  nbytes=f8_bytes + (m * k + m * n) * 2, flops=2 * m * n * k, bound=bound)
        for p in q4 + f8:
            B.be.free(p)
            B.bufs.remove(p)


# the types of the llama.cpp files people run most (Q4_K_M's bulk, its Q6_K tensors, Q8_0)
# and the plain 32-element Q4_0
GGUF_BENCH_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q4_0")


def bench_gemm_gguf(B, S):
    """The GEMM over GGUF weights kept at their bytes, at the same shapes and rows, for
    GGUF_BENCH_TYPES: bytes are the planes the kernel must read (q + qh + meta: the file's
    tensor bytes) plus X and Y, so decode rows compare with gemm_tc's and gemm_q's against
    the copy bandwidth."""
    from metrale.gpu_runtime import NULL
    from metrale.ops import gemm_gguf, gemm_tc
    from metrale.ops.gguf_planes import PACKED, plane_bytes
    by_name = {t.name: ggml_type for ggml_type, t in PACKED.items()}
    rows = (*S["rows"], S["tokens"])
    x = B.buf(max(rows) * max(S["hidden"], S["inter"]) * 2)
    y = B.buf(max(rows) * max(2 * S["inter"], S["vocab"]) * 2)
    for name, n, k in linear_shapes(S):
        for tname in GGUF_BENCH_TYPES:
            ggml_type = by_name[tname]
            q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
            # codes 0x5A, high bits 0x0F, scale fields 0x1C (f16 0x1C1C ~ 0.004, 6-bit 28)
            w = [B.buf(n * q_row, 0x5A), B.buf(n * qh_row, 0x0F) if qh_row else NULL,
                 B.buf(n * meta_row, 0x1C)]
            w_bytes = n * (q_row + qh_row + meta_row)
            for m in rows:
                shape = dict(m=m, n=n, k=k, type=tname, tile=gemm_tc.pick_tile(m, n).name)
                B.run("gemm_gguf", f"gemm_gguf_{tname.lower()}_bf16 {name}", shape,
                      lambda s, m=m, n=n, k=k, w=w, t=ggml_type: gemm_gguf.gemm_gguf(
                          B.be, s, y, x, w[0], w[1], w[2], m, n, k, t),
                      nbytes=w_bytes + (m * k + m * n) * 2, flops=2 * m * n * k,
                      bound="compute" if m >= 256 else "memory")
            for p in w:
                if int(p):
                    B.be.free(p)
                    B.bufs.remove(p)


def bench_rope(B, S):
    from metrale.ops import rope
    T, H, KV, D = S["tokens"], S["H"], S["KV"], S["D"]
    maxp = max(S["kv_len"], T)
    qkv = B.buf(T * (H + 2 * KV) * D * 2)
    table = B.upload(rope.rope_table(D, maxp, 500000.0, None))
    pos = B.upload(np.arange(T, dtype=np.int32) % maxp)
    B.run("rope", "apply_rope", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
          lambda s: rope.apply_rope(B.be, s, qkv, pos, table, T, H, KV, D, maxp),
          nbytes=2 * T * (H + KV) * D * 2 + T * D * 4 + T * 4)
    qn, kn = B.buf(D * 2), B.buf(D * 2)
    B.run("rope", "apply_rope+qk_norm", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
          lambda s: rope.apply_rope(B.be, s, qkv, pos, table, T, H, KV, D, maxp, qn, kn, 1e-6),
          nbytes=2 * T * (H + KV) * D * 2 + T * D * 4 + T * 4)
    # Gemma 3's q/k norm with (1 + w); a partial rotary embedding (Phi-4-mini: 3/4 of D)
    B.run("rope", "apply_rope+gemma_qk_norm", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
          lambda s: rope.apply_rope(B.be, s, qkv, pos, table, T, H, KV, D, maxp, qn, kn, 1e-6,
                                    gemma_norm=True),
          nbytes=2 * T * (H + KV) * D * 2 + T * D * 4 + T * 4)
    rd = D * 3 // 4
    part = B.upload(rope.rope_table(rd, maxp, 10000.0, None))
    B.run("rope", "apply_rope partial", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D,
                                            rotary_dim=rd),
          lambda s: rope.apply_rope(B.be, s, qkv, pos, part, T, H, KV, D, maxp, rotary_dim=rd),
          nbytes=2 * T * (H + KV) * D * 2 + T * rd * 4 + T * 4)
    # the model's launch: rope and the k/v cache write together (bytes: rope's, the v heads
    # read, k and v written to the cache, the slots)
    kc, vc, _, _ = _paged(B, S, 1, T)
    slots = B.upload(np.arange(T, dtype=np.int32))
    B.run("rope", "rope_write_kv", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
          lambda s: rope.rope_write_kv(B.be, s, qkv, pos, table, kc, vc, slots, T, H, KV, D,
                                       maxp),
          nbytes=2 * T * (H + KV) * D * 2 + T * D * 4 + T * 4 + 3 * T * KV * D * 2 + T * 4)


def _paged(B, S, n_seqs, kv_len):
    bs, KV, D = S["block"], S["KV"], S["D"]
    mb = -(-kv_len // bs)
    nblocks = n_seqs * mb
    kc, vc = B.buf(nblocks * bs * KV * D * 2), B.buf(nblocks * bs * KV * D * 2)
    tables = B.upload(np.arange(nblocks, dtype=np.int32).reshape(n_seqs, mb))
    return kc, vc, tables, mb


def bench_kv_cache(B, S):
    from metrale.ops import kv_cache
    T, H, KV, D = S["tokens"], S["H"], S["KV"], S["D"]
    qkv = B.buf(T * (H + 2 * KV) * D * 2)
    kc, vc, _, _ = _paged(B, S, 1, T)
    slots = B.upload(np.arange(T, dtype=np.int32))
    B.run("kv_cache", "write_kv", dict(n_tokens=T, kv_heads=KV, head_dim=D),
          lambda s: kv_cache.write_kv(B.be, s, qkv, kc, vc, slots, T, H, KV, D),
          nbytes=2 * 2 * T * KV * D * 2 + T * 4)


def bench_attention(B, S):
    from metrale.ops import attention
    H, KV, D, bs = S["H"], S["KV"], S["D"], S["block"]
    scale = 1.0 / D ** 0.5
    T = S["tokens"]
    qkv = B.buf(T * (H + 2 * KV) * D * 2)
    out = B.buf(T * H * D * 2)
    kc, vc, tables, mb = _paged(B, S, 1, T)
    lens = B.upload(np.array([T], np.int32))
    indptr = B.upload(np.array([0, T], np.int32))
    B.run("attention", "prefill_attention", dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
          lambda s: attention.prefill_attention(B.be, s, out, qkv, kc, vc, tables, lens, indptr,
                                                1, T, T, H, KV, D, bs, mb, scale),
          flops=4 * H * D * (T * (T + 1) // 2), bound="compute")
    # issue 40's options: Gemma 2's soft-capping (a tanh per score), gpt-oss's sinks
    sinks = B.upload(np.linspace(-1.0, 1.0, H).astype(np.float32))
    for name, opts in (("softcap", dict(softcap=50.0)), ("sinks", dict(sinks_ptr=sinks))):
        B.run("attention", f"prefill_attention {name}",
              dict(n_tokens=T, heads=H, kv_heads=KV, head_dim=D),
              lambda s, opts=opts: attention.prefill_attention(
                  B.be, s, out, qkv, kc, vc, tables, lens, indptr, 1, T, T, H, KV, D, bs, mb,
                  scale, **opts),
              flops=4 * H * D * (T * (T + 1) // 2), bound="compute")
    L = S["kv_len"]
    for n in S["rows"]:
        kc, vc, tables, mb = _paged(B, S, n, L)
        lens = B.upload(np.full(n, L, np.int32))
        splits = attention.decode_max_splits(mb * bs)
        ws = B.buf(attention.decode_workspace_bytes(n, H, D, splits))
        B.run("attention", "decode_attention", dict(n_seqs=n, kv_len=L, heads=H, kv_heads=KV,
                                                    head_dim=D),
              lambda s, kc=kc, vc=vc, tables=tables, lens=lens, mb=mb, ws=ws, n=n, sp=splits:
              attention.decode_attention(B.be, s, out, qkv, kc, vc, tables, lens, n, H, KV, D,
                                         bs, mb, scale, ws, sp),
              nbytes=n * L * 2 * KV * D * 2 + 2 * n * H * D * 2, flops=4 * n * H * D * L)
        B.run("attention", "decode_attention softcap+sinks",
              dict(n_seqs=n, kv_len=L, heads=H, kv_heads=KV, head_dim=D),
              lambda s, kc=kc, vc=vc, tables=tables, lens=lens, mb=mb, ws=ws, n=n, sp=splits:
              attention.decode_attention(B.be, s, out, qkv, kc, vc, tables, lens, n, H, KV, D,
                                         bs, mb, scale, ws, sp, softcap=50.0, sinks_ptr=sinks),
              nbytes=n * L * 2 * KV * D * 2 + 2 * n * H * D * 2, flops=4 * n * H * D * L)
        for p in (kc, vc, ws):
            B.be.free(p)
            B.bufs.remove(p)


def bench_attention_tc(B, S):
    """The tensor-core prefill attention against the CUDA-core one (the "attention" family's
    prefill_attention row has the same whole-prompt shape): the whole prompt, and its last
    chunk of T/8 rows against the cached prefix (where GQA rows fill the tiles)."""
    from metrale.ops import attention, attention_tc
    H, KV, D, bs = S["H"], S["KV"], S["D"], S["block"]
    scale = 1.0 / D ** 0.5
    T = S["tokens"]
    qkv = B.buf(T * (H + 2 * KV) * D * 2)
    out = B.buf(T * H * D * 2)
    kc, vc, tables, mb = _paged(B, S, 1, T)
    lens = B.upload(np.array([T], np.int32))
    whole = B.upload(np.array([0, T], np.int32))
    shape = dict(n_tokens=T, kv_len=T, heads=H, kv_heads=KV, head_dim=D)
    B.run("attention_tc", "prefill_attention_tc", shape,
          lambda s: attention_tc.prefill_attention_tc(B.be, s, out, qkv, kc, vc, tables, lens,
                                                      whole, 1, T, T, H, KV, D, bs, mb, scale),
          flops=4 * H * D * (T * (T + 1) // 2), bound="compute")
    sinks = B.upload(np.linspace(-1.0, 1.0, H).astype(np.float32))
    B.run("attention_tc", "prefill_attention_tc softcap+sinks", shape,
          lambda s: attention_tc.prefill_attention_tc(B.be, s, out, qkv, kc, vc, tables, lens,
                                                      whole, 1, T, T, H, KV, D, bs, mb, scale,
                                                      softcap=50.0, sinks_ptr=sinks),
          flops=4 * H * D * (T * (T + 1) // 2), bound="compute")
    n = T // 8
    indptr = B.upload(np.array([0, n], np.int32))
    chunk = dict(shape, n_tokens=n)
    flops = 4 * H * D * (n * (T - n) + n * (n + 1) // 2)
    for mod, fn in (("attention_tc", attention_tc.prefill_attention_tc),
                    ("attention", attention.prefill_attention)):
        B.run(mod, f"{fn.__name__} chunk", chunk,
              lambda s, fn=fn: fn(B.be, s, out, qkv, kc, vc, tables, lens, indptr, 1, n, n, H,
                                  KV, D, bs, mb, scale),
              flops=flops, bound="compute")


def bench_argmax(B, S):
    from metrale.ops import argmax
    V, n = S["vocab"], max(S["rows"])
    logits, out = B.buf(n * V * 4), B.buf(n * 4)
    B.run("argmax", "argmax_bf16", dict(vocab=V),
          lambda s: argmax.argmax_bf16(B.be, s, logits, out, V), nbytes=V * 2)
    B.run("argmax", "argmax_bf16_batch", dict(n_rows=n, vocab=V),
          lambda s: argmax.argmax_bf16_batch(B.be, s, logits, out, n, V), nbytes=n * V * 2)
    B.run("argmax", "argmax_fp32", dict(n_rows=n, vocab=V),
          lambda s: argmax.argmax_fp32(B.be, s, logits, out, n, V), nbytes=n * V * 4)
    for rows in (1, n):    # the engine's NaN/Inf check: one row (generate), a decode batch
        B.run("argmax", "count_nonfinite_bf16", dict(n_rows=rows, vocab=V),
              lambda s, r=rows: argmax.count_nonfinite(B.be, s, logits, out, r, V),
              nbytes=rows * V * 2)


def bench_sampling(B, S):
    from metrale.engine.sampling import SamplingParams
    from metrale.ops import sampling
    V, n = S["vocab"], max(S["rows"])
    logits, out = B.buf(n * V * 2), B.buf(n * 4)
    params = B.upload(sampling.pack_params(
        [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * n))
    seeds = B.upload(np.arange(n, dtype=np.uint64))
    steps = B.upload(np.zeros(n, np.uint64))
    ws = B.buf(sampling.workspace_bytes(n, V))
    B.run("sampling", "sample_rows", dict(n_rows=n, vocab=V, top_k=50, top_p=0.9),
          lambda s: sampling.sample_rows(B.be, s, out, logits, False, n, V, params, seeds,
                                         steps, 0, 0, 0, ws),
          nbytes=n * V * (2 + 4))


def bench_conv1d(B, S):
    from metrale.ops import conv1d
    L, c_in, c_out = S["frames"], S["mel"], S["d_model"]
    x, h = B.buf(L * max(c_in, c_out) * 2), B.buf(L * c_out * 2)
    w1, w2, b = B.buf(c_out * 3 * c_in * 2), B.buf(c_out * 3 * c_out * 2), B.buf(c_out * 2)
    B.run("conv1d", "conv1 (k3 s1)", dict(length=L, c_in=c_in, c_out=c_out),
          lambda s: conv1d.conv1d(B.be, s, h, x, w1, b, c_in, c_out, L, 3, 1, 1, True),
          flops=2 * L * c_out * 3 * c_in, bound="compute")
    lo = conv1d.output_length(L, 3, 2, 1)
    B.run("conv1d", "conv2 (k3 s2)", dict(length=L, c_in=c_out, c_out=c_out),
          lambda s: conv1d.conv1d(B.be, s, x, h, w2, b, c_out, c_out, L, 3, 2, 1, True),
          flops=2 * lo * c_out * 3 * c_out, bound="compute")


def bench_dense_attention(B, S):
    from metrale.ops import dense_attention as da
    n, H, d = S["enc_len"], S["enc_heads"], S["d_model"]
    D = d // H
    scale = 1.0 / D ** 0.5
    qkv = B.buf(n * 3 * d * 2)
    out = B.buf(n * d * 2)
    k, v = qkv.offset(d * 2), qkv.offset(2 * d * 2)
    B.run("dense_attention", "encoder self-attention", dict(n=n, heads=H, head_dim=D),
          lambda s: da.dense_attention(B.be, s, out, qkv, k, v, n, n, H, H, D, 3 * d, 3 * d,
                                       scale, False),
          flops=4 * H * D * n * n, bound="compute")
    q = B.buf(d * 2)
    kv = B.buf(n * 2 * d * 2)
    B.run("dense_attention", "cross-attention decode", dict(n_q=1, n_kv=n, heads=H,
                                                            head_dim=D),
          lambda s: da.dense_attention(B.be, s, out, q, kv, kv.offset(d * 2), 1, n, H, H, D,
                                       d, 2 * d, scale, False),
          nbytes=2 * n * d * 2 + 2 * d * 2, flops=4 * H * D * n)


def bench_vision(B, S):
    from metrale.ops import vision
    img, p, hid = S["image"], S["patch"], S["vit_hidden"]
    n = vision.num_patches(img, img, p)
    pix, out = B.buf(3 * img * img * 4), B.buf(n * 3 * p * p * 2)
    B.run("vision", "patchify", dict(channels=3, image=img, patch=p),
          lambda s: vision.patchify(B.be, s, out, pix, 3, img, img, p),
          nbytes=3 * img * img * 4 + n * 3 * p * p * 2)
    x, cls, pos = B.buf((n + 1) * hid * 2), B.buf(hid * 2), B.buf((n + 1) * hid * 2)
    B.run("vision", "class_pos_embed", dict(n_rows=n + 1, hidden=hid),
          lambda s: vision.class_pos_embed(B.be, s, x, cls, pos, n + 1, hid),
          nbytes=3 * (n + 1) * hid * 2)


def _moe_routing(B, tokens, E, k):
    """Device row lists of a random routing (distinct experts per token) for the tile the
    model would pick: (pairs, offsets, tiles pointers, tile, distinct experts hit)."""
    from metrale.ops import moe_gemm
    from metrale.ops.moe_router import route
    rng = np.random.default_rng(tokens)
    ids = np.argsort(rng.random((tokens, E)), axis=1)[:, :k]
    tile = moe_gemm.pick_tile(tokens * k, E)
    pairs, offsets, tiles = route(ids.reshape(-1), E, tile.bm)
    return (B.upload(pairs), B.upload(offsets), B.upload(tiles), tile,
            len(np.unique(ids)), ids.astype(np.int32))


def bench_moe_router(B, S):
    from metrale.ops import moe_router
    E, k, _, _ = S["moe"]
    for n in (*S["rows"], S["tokens"]):
        logits, ids, w = B.buf(n * E * 4), B.buf(n * k * 4), B.buf(n * k * 4)
        B.run("moe_router", "moe_topk_softmax", dict(n_tokens=n, num_experts=E, top_k=k),
              lambda s, n=n, logits=logits, ids=ids, w=w: moe_router.moe_topk_softmax(
                  B.be, s, ids, w, logits, n, E, k, True), nbytes=n * E * 4 + n * k * 8)
        bias = B.buf(E * 2)   # gpt-oss's router bias
        B.run("moe_router", "moe_topk_softmax+bias", dict(n_tokens=n, num_experts=E, top_k=k),
              lambda s, n=n, logits=logits, ids=ids, w=w, bias=bias:
              moe_router.moe_topk_softmax(B.be, s, ids, w, logits, n, E, k, True, bias),
              nbytes=n * E * 4 + n * k * 8 + E * 2)
        *_, routed = _moe_routing(B, n, E, k)
        idp = B.upload(routed)
        sp, op, tp = B.buf(n * k * 4), B.buf((E + 1) * 4), B.buf((E + 1) * 4)
        B.run("moe_router", "moe_route", dict(n_pairs=n * k, num_experts=E, block_m=16),
              lambda s, n=n, idp=idp, sp=sp, op=op, tp=tp: moe_router.moe_route(
                  B.be, s, sp, op, tp, idp, n * k, E, 16), nbytes=n * k * 8)


def bench_moe_gemm(B, S):
    """gate_up (x gathered per token) and down (per pair, FP32 out) at decode batches and a
    prefill chunk; bytes = the hit experts' weights + activations."""
    from metrale.ops import moe_gemm
    E, k, hid, inter = S["moe"]
    for n in (*S["rows"], S["tokens"]):
        sp, op, tp, tile, hit, _ = _moe_routing(B, n, E, k)
        pairs = n * k
        x, act = B.buf(n * hid * 2), B.buf(pairs * inter * 2)
        gu, y = B.buf(pairs * 2 * inter * 2), B.buf(pairs * hid * 4)
        for name, w_rows, w_k, xp, yp, div, fp32, out_b in (
                ("gate_up", 2 * inter, hid, x, gu, k, False, 2),
                ("down", hid, inter, act, y, 1, True, 4)):
            w = B.buf(E * w_rows * w_k * 2)
            B.run("moe_gemm", f"moe_gemm {name} {tile.name}",
                  dict(tokens=n, top_k=k, experts=E, n=w_rows, k=w_k),
                  lambda s, w=w, w_rows=w_rows, w_k=w_k, xp=xp, yp=yp, div=div, fp32=fp32:
                  moe_gemm.moe_gemm(B.be, s, yp, xp, w, sp, op, tp, pairs, E, w_rows, w_k, div,
                                    fp32, tile.name),
                  nbytes=hit * w_rows * w_k * 2 + pairs * (w_k * 2 + w_rows * out_b),
                  flops=2 * pairs * w_rows * w_k, bound="compute" if n >= 256 else "memory")
            # gpt-oss: the experts' biases, and their MXFP4 form (4.25 bits a weight)
            bias = B.buf(E * w_rows * 2)
            B.run("moe_gemm", f"moe_gemm {name}+bias {tile.name}",
                  dict(tokens=n, top_k=k, experts=E, n=w_rows, k=w_k),
                  lambda s, w=w, w_rows=w_rows, w_k=w_k, xp=xp, yp=yp, div=div, fp32=fp32,
                  bias=bias: moe_gemm.moe_gemm(B.be, s, yp, xp, w, sp, op, tp, pairs, E,
                                               w_rows, w_k, div, fp32, tile.name, bias),
                  nbytes=hit * w_rows * (w_k * 2 + 2) + pairs * (w_k * 2 + w_rows * out_b),
                  flops=2 * pairs * w_rows * w_k, bound="compute" if n >= 256 else "memory")
            blocks = B.buf(E * w_rows * w_k // 2, fill=0x11)
            scales = B.buf(E * w_rows * w_k // 32, fill=0x7C)   # 2^-3: valid e8m0 scales
            B.run("moe_gemm", f"moe_gemm_mxfp4 {name} {tile.name}",
                  dict(tokens=n, top_k=k, experts=E, n=w_rows, k=w_k),
                  lambda s, w_rows=w_rows, w_k=w_k, xp=xp, yp=yp, div=div, fp32=fp32,
                  blocks=blocks, scales=scales: moe_gemm.moe_gemm_mxfp4(
                      B.be, s, yp, xp, blocks, scales, sp, op, tp, pairs, E, w_rows, w_k, div,
                      fp32, tile.name),
                  nbytes=hit * w_rows * w_k * 17 // 32 + pairs * (w_k * 2 + w_rows * out_b),
                  flops=2 * pairs * w_rows * w_k, bound="compute" if n >= 256 else "memory")


def bench_moe_gemm_q(B, S):
    """The grouped GEMM over quantized experts (Qwen3-MoE FP8 / GPTQ / AWQ releases) at the
    shapes of bench_moe_gemm: FP8 with 128x128 block scales (1 byte a weight) and 4-bit
    with groups of 128 (an FP16 scale and a zero byte each); bytes = the hit experts'
    packed weights and scales + activations."""
    from metrale.ops import gemm_q, moe_gemm_q
    E, k, hid, inter = S["moe"]
    for n in (*S["rows"], S["tokens"]):
        sp, op, tp, tile, hit, _ = _moe_routing(B, n, E, k)
        pairs = n * k
        x, act = B.buf(n * hid * 2), B.buf(pairs * inter * 2)
        gu, y = B.buf(pairs * 2 * inter * 2), B.buf(pairs * hid * 4)
        for name, w_rows, w_k, xp, yp, div, fp32, out_b in (
                ("gate_up", 2 * inter, hid, x, gu, k, False, 2),
                ("down", hid, inter, act, y, 1, True, 4)):
            dims = dict(tokens=n, top_k=k, experts=E, n=w_rows, k=w_k)
            io = pairs * (w_k * 2 + w_rows * out_b)
            kb = -(-w_k // 128)
            q8 = B.buf(E * w_rows * gemm_q.fp8_row_bytes(w_k))
            s8 = B.buf(E * -(-w_rows // 128) * kb * 4)
            r8 = B.buf(E * w_rows * 4, fill=0)   # every row scaled by scale row 0
            B.run("moe_gemm_q", f"moe_gemm_fp8 {name} {tile.name}", dims,
                  lambda s, w_rows=w_rows, w_k=w_k, xp=xp, yp=yp, div=div, fp32=fp32, q8=q8,
                  s8=s8, r8=r8, kb=kb: moe_gemm_q.moe_gemm_fp8(
                      B.be, s, yp, xp, q8, s8, r8, sp, op, tp, pairs, E, w_rows, w_k, div, kb,
                      128, fp32, tile.name),
                  nbytes=hit * w_rows * (w_k + kb * 4) + io,
                  flops=2 * pairs * w_rows * w_k, bound="compute" if n >= 256 else "memory")
            g = -(-w_k // 128)
            q4 = B.buf(E * w_rows * gemm_q.q4_row_bytes(w_k))
            s4, z4 = B.buf(E * w_rows * g * 2), B.buf(E * w_rows * g)
            B.run("moe_gemm_q", f"moe_gemm_q4 {name} {tile.name}", dims,
                  lambda s, w_rows=w_rows, w_k=w_k, xp=xp, yp=yp, div=div, fp32=fp32, q4=q4,
                  s4=s4, z4=z4, g=g: moe_gemm_q.moe_gemm_q4(
                      B.be, s, yp, xp, q4, s4, z4, 0, 0, sp, op, tp, pairs, E, w_rows, w_k,
                      div, g, 128, fp32, tile.name),
                  nbytes=hit * w_rows * (w_k // 2 + g * 3) + io,
                  flops=2 * pairs * w_rows * w_k, bound="compute" if n >= 256 else "memory")


def bench_moe_combine(B, S):
    from metrale.ops import moe_combine
    E, k, hid, _ = S["moe"]
    for n in (*S["rows"], S["tokens"]):
        y, w, sh, g, out = (B.buf(n * k * hid * 4), B.buf(n * k * 4), B.buf(n * hid * 4),
                            B.buf(n * 4), B.buf(n * hid * 2))
        B.run("moe_combine", "moe_combine", dict(n_tokens=n, top_k=k, hidden=hid),
              lambda s, n=n, y=y, w=w, out=out: moe_combine.moe_combine(
                  B.be, s, out, y, w, n, hid, k), nbytes=n * k * (hid + 1) * 4 + n * hid * 2)
        B.run("moe_combine", "moe_combine+shared", dict(n_tokens=n, top_k=k, hidden=hid),
              lambda s, n=n, y=y, w=w, out=out, sh=sh, g=g: moe_combine.moe_combine(
                  B.be, s, out, y, w, n, hid, k, sh, g),
              nbytes=n * k * (hid + 1) * 4 + n * (hid + 1) * 4 + n * hid * 2)


def _ragged(B, lens):
    """Device (cu_seqlens, slots, start_pos) of fresh sequences of `lens` tokens."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (B.upload(cu), B.upload(np.arange(len(lens), dtype=np.int32)),
            B.upload(np.zeros(len(lens), np.int32)))


def _prefills(S):
    """(name, lens) of the prefill rows: one sequence of `tokens`, and four of a quarter."""
    T = S["tokens"]
    return [(f"1x{T}", [T]), (f"4x{T // 4}", [T // 4] * 4)]


def bench_causal_conv1d(B, S):
    from metrale.ops import causal_conv1d as cc
    Hk, Hv, dk, dv = S["gdn"]
    H, G, P, N, _ = S["ssd"]
    for model, C in (("qwen3.5 q|k|v", 2 * Hk * dk + Hv * dv), ("nemotron-h x|B|C",
                                                                H * P + 2 * G * N)):
        w, bias = B.buf(C * 4 * 2), B.buf(C * 2)
        ss = cc.state_elements(C, 4)
        for n in S["rows"]:
            x, out, pool = B.buf(n * C * 2), B.buf(n * C * 2), B.buf(n * ss * 2)
            slots = B.upload(np.arange(n, dtype=np.int32))
            B.run("causal_conv1d", f"update {model}", dict(n_seqs=n, channels=C, width=4),
                  lambda s, x=x, out=out, pool=pool, slots=slots, n=n: cc.causal_conv1d_update(
                      B.be, s, out, C, x, C, w, bias, pool, ss, slots, n, C, 4),
                  nbytes=n * C * 2 * 2 + n * ss * 2 * 2 + C * 5 * 2)
        for name, lens in _prefills(S):
            T = sum(lens)
            x, out, pool = B.buf(T * C * 2), B.buf(T * C * 2), B.buf(len(lens) * ss * 2)
            cu, slots, start = _ragged(B, lens)
            B.run("causal_conv1d", f"prefill {model} {name}", dict(tokens=T, channels=C),
                  lambda s, x=x, out=out, pool=pool, cu=cu, slots=slots, start=start, lens=lens:
                  cc.causal_conv1d_prefill(B.be, s, out, C, x, C, w, bias, pool, ss, slots, cu,
                                           start, len(lens), max(lens), C, 4),
                  nbytes=2 * T * C * 2 + len(lens) * ss * 2 * 2 + C * 5 * 2)


def bench_gated_delta_rule(B, S):
    """Decode: bound by the FP32 state (read + write); prefill: FLOPs of the chunked form
    (K K^T, Q K^T, K S, Q S, the substitution, (QK^T) X and K^T X per 64-token chunk)."""
    from metrale.ops import gated_delta_rule as gdr
    Hk, Hv, dk, dv = S["gdn"]
    stride = 2 * Hk * dk + Hv * dv
    ss = gdr.state_elements(Hv, dk, dv)
    a_log, dt_bias = B.buf(Hv * 4), B.buf(Hv * 4)

    for n in S["rows"]:
        qkv, ab, out = B.buf(n * stride * 2), B.buf(n * 2 * Hv * 2), B.buf(n * Hv * dv * 2)
        pool, slots = B.buf(n * ss * 4), B.upload(np.arange(n, dtype=np.int32))
        B.run("gated_delta_rule", "gdr_decode", dict(n_seqs=n, n_k_heads=Hk, n_v_heads=Hv,
                                                     d_k=dk, d_v=dv),
              lambda s, n=n, qkv=qkv, ab=ab, out=out, pool=pool, slots=slots: gdr.gdr_decode(
                  B.be, s, out, qkv, qkv.offset(2 * Hk * dk), qkv.offset(4 * Hk * dk), stride,
                  ab, ab.offset(2 * Hv), 2 * Hv, a_log, dt_bias, pool, ss, slots, n, Hk, Hv,
                  dk, dv),
              nbytes=n * (ss * 4 * 2 + stride * 2 + Hv * dv * 2 + 4 * Hv))
    per_chunk = 2 * Hv * (2 * 64 * 64 * dk + 3 * 64 * dk * dv + 64 * 64 * dv)
    for name, lens in _prefills(S):
        T = sum(lens)
        qkv, ab, out = B.buf(T * stride * 2), B.buf(T * 2 * Hv * 2), B.buf(T * Hv * dv * 2)
        pool = B.buf(len(lens) * ss * 4)
        cu, slots, start = _ragged(B, lens)
        B.run("gated_delta_rule", f"gdr_prefill {name}", dict(tokens=T, n_k_heads=Hk,
                                                              n_v_heads=Hv, d_k=dk, d_v=dv),
              lambda s, qkv=qkv, ab=ab, out=out, pool=pool, cu=cu, slots=slots, start=start,
              lens=lens: gdr.gdr_prefill(
                  B.be, s, out, qkv, qkv.offset(2 * Hk * dk), qkv.offset(4 * Hk * dk), stride,
                  ab, ab.offset(2 * Hv), 2 * Hv, a_log, dt_bias, pool, ss, slots, cu, start,
                  len(lens), Hk, Hv, dk, dv),
              flops=per_chunk * sum(-(-n // 64) for n in lens), bound="compute")


def bench_mamba2_ssd(B, S):
    """Decode: bound by the FP32 state; prefill: FLOPs of the chunked scan (C B^T, G xt,
    C S and xt B per chunk)."""
    from metrale.ops import mamba2_ssd as m2
    H, G, P, N, chunk = S["ssd"]
    stride = H * P + 2 * G * N
    ss = m2.state_elements(H, P, N)
    a_log, dt_bias, D = B.buf(H * 4), B.buf(H * 4), B.buf(H * 4)
    for n in S["rows"]:
        xbc, dt, out = B.buf(n * stride * 2), B.buf(n * H * 2), B.buf(n * H * P * 2)
        pool, slots = B.buf(n * ss * 4), B.upload(np.arange(n, dtype=np.int32))
        B.run("mamba2_ssd", "mamba2_step", dict(n_seqs=n, n_heads=H, n_groups=G, head_dim=P,
                                                d_state=N),
              lambda s, n=n, xbc=xbc, dt=dt, out=out, pool=pool, slots=slots: m2.mamba2_step(
                  B.be, s, out, xbc, stride, xbc.offset(2 * H * P),
                  xbc.offset(2 * (H * P + G * N)), stride, dt, H, a_log, dt_bias, D, 0.0,
                  float("inf"), pool, ss, slots, n, H, G, P, N),
              nbytes=n * (ss * 4 * 2 + stride * 2 + H * P * 2 + 2 * H))
    for name, lens in _prefills(S):
        T = sum(lens)
        xbc, dt, out = B.buf(T * stride * 2), B.buf(T * H * 2), B.buf(T * H * P * 2)
        pool = B.buf(len(lens) * ss * 4)
        cu, slots, start = _ragged(B, lens)
        flops = 2 * H * sum(n * (min(n, chunk) * (N + P) + 2 * N * P) for n in lens)
        B.run("mamba2_ssd", f"mamba2_prefill {name}", dict(tokens=T, n_heads=H, n_groups=G,
                                                           head_dim=P, d_state=N, chunk=chunk),
              lambda s, xbc=xbc, dt=dt, out=out, pool=pool, cu=cu, slots=slots, start=start,
              lens=lens: m2.mamba2_prefill(
                  B.be, s, out, xbc, stride, xbc.offset(2 * H * P),
                  xbc.offset(2 * (H * P + G * N)), stride, dt, H, a_log, dt_bias, D, 0.0,
                  float("inf"), pool, ss, slots, cu, start, len(lens), H, G, P, N, chunk),
              flops=flops, bound="compute")


def bench_lora(B, S, adapters: int = 4, rank: int = 16):
    """The grouped LoRA GEMMs at the model's four fused groups (q|k|v, o, gate|up, down):
    decode rows spread over `adapters` adapters of rank `rank` (row i -> adapter i mod 4, one
    row per tile), and a prefill chunk of one adapter (8-row tiles). Bytes: x, each adapter's
    A (B) read once, t, and y read and written; FLOPs 2 m c k (shrink), 2 m n rank
    (expand)."""
    from metrale.ops import lora
    hid, inter, H, KV, D = S["hidden"], S["inter"], S["H"], S["KV"], S["D"]
    groups = [("qkv", hid, [H * D, (H + KV) * D, (H + 2 * KV) * D]), ("o", H * D, [hid]),
              ("gate_up", hid, [inter, 2 * inter]), ("down", inter, [hid])]
    for name, k, ends in groups:
        n, c = ends[-1], len(ends) * rank
        a, b = B.buf(adapters * c * k * 2), B.buf(adapters * n * rank * 2)
        scale = B.upload(np.ones(adapters * len(ends), np.float32))
        for m in list(S["rows"]) + [S["tokens"]]:
            per = 8 if m == S["tokens"] else 1
            slots = [0] * m if per == 8 else [i % adapters for i in range(m)]
            used = len(set(slots))
            tiles = lora.build_tiles(slots, per)
            tl = B.upload(tiles)
            x, y, t = B.buf(m * k * 2), B.buf(m * n * 2), B.buf(m * c * 4)
            shape = dict(group=name, m=m, k=k, n=n, rank=rank, adapters=used)
            B.run("lora", f"shrink {name}", shape,
                  lambda s, x=x, t=t, tl=tl, m=m, nt=len(tiles), per=per: lora.lora_shrink(
                      B.be, s, t, x, a, c * k, tl, nt, m, k, c, adapters, per),
                  nbytes=m * k * 2 + used * c * k * 2 + m * c * 4, flops=2 * m * c * k)
            B.run("lora", f"expand {name}", shape,
                  lambda s, y=y, t=t, tl=tl, m=m, nt=len(tiles), per=per: lora.lora_expand(
                      B.be, s, y, t, b, n * rank, scale, tl, nt, m, n, rank, ends, adapters,
                      per),
                  nbytes=2 * m * n * 2 + used * n * rank * 2 + m * c * 4,
                  flops=2 * m * n * rank)


def bench_gated_norm(B, S):
    """The hybrid models' norms and gates at Qwen3.5-0.8B's shapes: bound by the rows read and
    written."""
    from metrale.ops import gated_norm as gn
    T, hid = S["tokens"], S["hidden"]
    Hk, Hv, dk, dv = S["gdn"]
    x, out, res, w = B.buf(T * hid * 2), B.buf(T * hid * 2), B.buf(T * hid * 2), B.buf(hid * 2)
    B.run("gated_norm", "rmsnorm_offset+residual", dict(n_rows=T, hidden=hid),
          lambda s: gn.rmsnorm_offset(B.be, s, out, x, w, T, hid, 1e-6, residual_ptr=res),
          nbytes=4 * T * hid * 2)
    V = Hv * dv
    core, z, wv = B.buf(T * V * 2), B.buf(T * V * 2), B.buf(dv * 2)
    B.run("gated_norm", "rmsnorm_gated norm-first", dict(tokens=T, width=V, group=dv),
          lambda s: gn.rmsnorm_gated(B.be, s, core, core, z, wv, T, V, dv, dv, V, 1e-6, True),
          nbytes=3 * T * V * 2)
    B.run("gated_norm", "sigmoid_gate_mul", dict(tokens=T, width=V),
          lambda s: gn.sigmoid_gate_mul(B.be, s, core, z, T, V, V), nbytes=3 * T * V * 2)
    I = S["inter"]
    act = B.buf(T * I * 2)
    B.run("gated_norm", "relu2", dict(n=T * I), lambda s: gn.relu2(B.be, s, act, T * I),
          nbytes=2 * T * I * 2)


# ops module -> its benchmark (the gemm module's kernels are "gemv"; cuBLAS is "gemm")
def bench_attention_mla(B, S):
    """DeepSeek-V3's absorbed MLA decode: every head over one read of the latent cache."""
    from metrale.ops import attention_mla
    H, R, dr = S["mla"][:3]
    D, bs, L = R + dr, S["block"], S["kv_len"]
    for n in S["rows"]:
        mb = -(-L // bs)
        cache = B.buf(n * mb * bs * D * 2)
        tables = B.upload(np.arange(n * mb, dtype=np.int32).reshape(n, mb))
        lens = B.upload(np.full(n, L, np.int32))
        q, out = B.buf(n * H * D * 2), B.buf(n * H * R * 2)
        splits = attention_mla.mla_max_splits(mb * bs)
        ws = B.buf(attention_mla.mla_workspace_bytes(n, H, R, splits))
        B.run("attention_mla", "attention_mla", dict(n_seqs=n, kv_len=L, heads=H, latent=D),
              lambda s, n=n, cache=cache, tables=tables, lens=lens, mb=mb, ws=ws, q=q, out=out,
              sp=splits: attention_mla.attention_mla(B.be, s, out, q, cache, tables, lens, n, H, R,
                                               dr, bs, mb, 0.1, ws, sp),
              nbytes=n * L * D * 2 + n * H * (D + R) * 2, flops=2 * n * H * L * (D + R))


def bench_mla_project(B, S):
    from metrale.ops import mla_project
    H, R, dr, dn, dv = S["mla"]
    T = S["tokens"]
    q, c, kr = B.buf(T * H * (dn + dr) * 2), B.buf(T * R * 2), B.buf(T * dr * 2)
    pos = B.upload(np.arange(T, dtype=np.int32))
    table = B.upload(np.ones((T, dr), np.float32))
    cache = B.buf(T * (R + dr) * 2)
    kvb = B.buf(H * (dn + dv) * R * 2)
    qa, lat, o = B.buf(T * H * (R + dr) * 2), B.buf(T * H * R * 2), B.buf(T * H * dv * 2)
    for n in S["rows"]:
        B.run("mla_project", "mla_rope_cache", dict(n_tokens=n, heads=H),
              lambda s, n=n: mla_project.mla_rope_cache(B.be, s, q, c, kr, pos, table, cache, pos,
                                                        n, H, dn, dr, R, T, True),
              nbytes=n * (2 * H * dr + R + 2 * dr) * 2)
        B.run("mla_project", "mla_absorb_q", dict(n_tokens=n, heads=H, nope=dn, latent=R),
              lambda s, n=n: mla_project.mla_absorb_q(B.be, s, qa, q, kvb, n, H, dn, dr, dv, R),
              nbytes=H * dn * R * 2 + n * H * (dn + R) * 2, flops=2 * n * H * dn * R)
        B.run("mla_project", "mla_expand_v", dict(n_tokens=n, heads=H, v=dv, latent=R),
              lambda s, n=n: mla_project.mla_expand_v(B.be, s, o, lat, kvb, n, H, dn, dv, R),
              nbytes=H * dv * R * 2 + n * H * (dv + R) * 2, flops=2 * n * H * dv * R)


def bench_deepseek_router(B, S):
    from metrale.ops import deepseek_router
    E, k, ng, tg = S["ds_router"]
    for n in (*S["rows"], S["tokens"]):
        logits = B.upload(np.random.default_rng(0).standard_normal((n, E)).astype(np.float32))
        bias = B.upload(np.zeros(E, np.float32))
        ids, w = B.buf(n * k * 4), B.buf(n * k * 4)
        B.run("deepseek_router", "moe_topk_grouped", dict(n_tokens=n, experts=E, top_k=k,
                                                         n_group=ng, topk_group=tg),
              lambda s, n=n, logits=logits, bias=bias, ids=ids, w=w:
              deepseek_router.moe_topk_grouped(B.be, s, ids, w, logits, n, E, k, ng, tg, 1, True,
                                               2.5, bias),
              nbytes=n * E * 4 + n * k * 8)


FAMILIES = {
    "embedding": [bench_embedding], "rmsnorm": [bench_rmsnorm],
    "activation": [bench_activation], "cast": [bench_cast],
    "elementwise": [bench_elementwise], "gemm": [bench_gemv, bench_gemm],
    "gemm_tc": [bench_gemm_tc], "gemm_fused": [bench_gemm_fused],
    "gemm_q": [bench_gemm_q], "gemm_gguf": [bench_gemm_gguf],
    "rope": [bench_rope], "kv_cache": [bench_kv_cache], "attention": [bench_attention],
    "argmax": [bench_argmax], "sampling": [bench_sampling], "conv1d": [bench_conv1d],
    "dense_attention": [bench_dense_attention],
    "vision": [bench_vision],
    "attention_tc": [bench_attention_tc],
    "moe_router": [bench_moe_router], "moe_gemm": [bench_moe_gemm],
    "moe_gemm_q": [bench_moe_gemm_q],
    "moe_combine": [bench_moe_combine],
    "tensor_parallel": [bench_tensor_parallel],
    "causal_conv1d": [bench_causal_conv1d], "gated_delta_rule": [bench_gated_delta_rule],
    "mamba2_ssd": [bench_mamba2_ssd], "lora": [bench_lora],
    "gated_norm": [bench_gated_norm],
    "attention_mla": [bench_attention_mla], "mla_project": [bench_mla_project],
    "deepseek_router": [bench_deepseek_router],
}
# helpers of metrale/ops with no kernel of their own (attention_tile: the twin of a header
# that attention.cu and dense_attention.cu share, benchmarked through them; attention_native:
# the decode twins' native path on HostBackend, timed through attention's rows; gguf_planes:
# the GGUF plane layout and its dequantization, timed through gemm_gguf's rows; lora_native:
# the LoRA twins' native path, timed through lora's rows)
NOT_KERNELS = {"bf16", "registry", "checks", "attention_tile", "attention_native",
               "gguf_planes",   # the GGUF planes' layout and formula (gemm_gguf runs them)
               # attention's split-K decode and shared checks (its kernels are attention's
               # rows) and rope's host-side table
               "attention_decode", "attention_common", "rope_table",
               "mxfp4",   # MXFP4's formula (moe_gemm's mxfp4 entries run it)
               "lora_native"}


def ops_modules() -> list[str]:
    import metrale.ops as ops
    return sorted(m.name for m in pkgutil.iter_modules(ops.__path__) if not m.ispkg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    ap.add_argument("--small", action="store_true",
                    help="small shapes (CPU smoke test); default on the CPU")
    ap.add_argument("--json", metavar="FILE", help="write the records as JSON")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10, "
                    "2 on the CPU)")
    ap.add_argument("--inner", type=int, default=None,
                    help="launches per timed repetition (default 5, 1 on the CPU)")
    ap.add_argument("--only", action="append", help="ops module(s) to run (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    be = pick_backend(args.device)
    on_gpu = roofline.is_device(be)
    small = args.small or not on_gpu
    S = SMALL if small else FULL
    B = Bench(be, reps=args.reps or (10 if on_gpu else 2), warmup=2 if on_gpu else 1,
              inner=args.inner or (5 if on_gpu else 1))
    modules = ops_modules()
    wanted = args.only or modules
    unknown = [m for m in wanted if m not in modules]
    if unknown:
        ap.error(f"unknown ops module(s) {unknown} (have {modules})")
    missing = []
    for mod in modules:
        if mod in NOT_KERNELS or mod not in wanted:
            continue
        fns = FAMILIES.get(mod)
        if not fns:
            missing.append(mod)
            continue
        for fn in fns:
            try:
                fn(B, S)
            except Exception as e:
                B.results.append({"family": mod, "kernel": fn.__name__,
                                  "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc(limit=4)})
            finally:
                B.free_all()
    report = environment(be)
    report.update({
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]) if argv is None
        else "bench_kernels.py " + " ".join(argv),
        "shapes": "small" if small else "llama-3.1-8b",
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in S.items()},
        "peaks": {"copy_gb_s": B.copy_gb_s, "gemm_bf16_tflops": B.gemm_tflops},
        "families": sorted(set(r["family"] for r in B.results)),
        "families_without_benchmark": missing,
        "results": B.results,
        "errors": sum(1 for r in B.results if "error" in r),
        "wall_s": time.perf_counter() - t0,
    })
    for r in B.results:
        if "error" in r:
            print(f"{r['family']:<12} {str(r['kernel']):<28} ERROR {r['error']}")
            continue
        perf = (f"{r['gb_s']:10.1f} GB/s" if r["bound"] == "memory" and r["gb_s"] is not None
                else f"{r['tflop_s']:10.2f} TFLOP/s" if r["tflop_s"] is not None else "")
        frac = "" if r["fraction_of_peak"] is None else f"  {r['fraction_of_peak']:.2f} of peak"
        print(f"{r['family']:<12} {r['kernel']:<28} {r['time_us']:12.1f} us {perf}{frac}")
    for mod in missing:
        print(f"WARNING: metrale/ops/{mod}.py has no benchmark in this script yet")
    print(f"peaks: copy {B.copy_gb_s} GB/s, BF16 GEMM {B.gemm_tflops} TFLOP/s; "
          f"{report['errors']} error(s); {report['wall_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
