#!/usr/bin/env python3
"""The recurrent layers' decode launches on the CPU (HostBackend: the twins, with the native
state steps of gpu_runtime/native_recurrent.py where they build), batch 1, against copying
the same state bytes on this machine (measured in the same run):

  Qwen3.5-0.8B gated DeltaNet layer (16 key / 16 value heads x 128: 1 MiB FP32 state,
      causal conv over 6144 channels: 36 KiB BF16 state), 18 such layers per token;
  Nemotron-H-8B Mamba2 layer (128 heads x 64, d_state 128: 4 MiB state).

    python benchmarks/recurrent_cpu_decode.py

Times are the best of 7 rounds of 40 launches (a shared machine's noise only adds). "copy"
reads and writes the state's bytes once (np.copyto over as many distinct buffers as the model
has such layers, so caches hold no more than a decode step would find there).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.gpu_runtime import HostBackend, native_recurrent  # noqa: E402
from metrale.ops import causal_conv1d as cc  # noqa: E402
from metrale.ops import gated_delta_rule as gdr  # noqa: E402
from metrale.ops import mamba2_ssd as m2  # noqa: E402


def best_us(fn, reps: int = 40, rounds: int = 7) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return min(times) * 1e6


def copy_us(elements: int, layers: int) -> float:
    src = [np.ones(elements, np.float32) for _ in range(layers)]
    dst = [np.empty(elements, np.float32) for _ in range(layers)]

    def run():
        for a, b in zip(src, dst):
            np.copyto(b, a)
    return best_us(run, 5) / layers


def main() -> int:
    be = HostBackend()
    rng = np.random.default_rng(0)

    def put(a):
        p = be.alloc(a.nbytes)
        be.copy_h2d(np.ascontiguousarray(a), p)
        return p

    def bf(shape, s=1.0):
        f = (rng.standard_normal(shape) * s).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    print("native state steps:", native_recurrent.for_backend(be) is not None)
    one = put(np.zeros(1, np.int32))
    # gated DeltaNet (random q|k|v rows: a zero input would decay the state to subnormals)
    Hk, Hv, dk, dv = 16, 16, 128, 128
    C = 2 * Hk * dk + Hv * dv
    ss, cs = gdr.state_elements(Hv, dk, dv), cc.state_elements(C, 4)
    qkv, conv_out = put(bf((1, C))), put(np.zeros((1, C), np.uint16))
    ab, out = put(bf((1, 2 * Hv))), put(np.zeros((1, Hv * dv), np.uint16))
    w, cpool = put(bf((C, 4), 0.3)), put(bf((1, 3, C)))
    pool = put((rng.standard_normal(ss) * 0.1).astype(np.float32))
    zero = put(np.zeros(Hv, np.float32))
    t_conv = best_us(lambda: cc.causal_conv1d_update(be, 0, conv_out, C, qkv, C, w, 0, cpool,
                                                     cs, one, 1, C, 4))
    t_rule = best_us(lambda: gdr.gdr_decode(be, 0, out, qkv, qkv.offset(2 * Hk * dk),
                                            qkv.offset(4 * Hk * dk), C, ab, ab.offset(2 * Hv),
                                            2 * Hv, zero, zero, pool, ss, one, 1, Hk, Hv, dk,
                                            dv))
    t_copy = copy_us(ss, 18)
    print(f"Qwen3.5-0.8B gated DeltaNet layer, batch 1: gdr_decode {t_rule:.0f} us + "
          f"causal_conv1d_update {t_conv:.0f} us; copying its {ss * 4 / 2**20:.0f} MiB state "
          f"(read + write) {t_copy:.0f} us ({2 * ss * 4 / t_copy / 1e3:.1f} GB/s): "
          f"{t_rule / t_copy:.2f}x; 18 layers {18 * (t_rule + t_conv) / 1e3:.1f} ms a token "
          f"against {18 * t_copy / 1e3:.1f} ms of state bytes")
    # Mamba2
    H, G, P, N = 128, 8, 64, 128
    stride = H * P + 2 * G * N
    ms = m2.state_elements(H, P, N)
    xbc, dtp, y = put(bf((1, stride))), put(bf((1, H))), put(np.zeros((1, H * P), np.uint16))
    mpool = put((rng.standard_normal(ms) * 0.1).astype(np.float32))
    hz = put(np.zeros(H, np.float32))
    t_step = best_us(lambda: m2.mamba2_step(be, 0, y, xbc, stride, xbc.offset(2 * H * P),
                                            xbc.offset(2 * (H * P + G * N)), stride, dtp, H, hz,
                                            hz, hz, 0.0, float("inf"), mpool, ms, one, 1, H, G,
                                            P, N))
    t_copy = copy_us(ms, 4)
    print(f"Nemotron-H-8B Mamba2 layer, batch 1: mamba2_step {t_step:.0f} us; copying its "
          f"{ms * 4 / 2**20:.0f} MiB state {t_copy:.0f} us: {t_step / t_copy:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
