#!/usr/bin/env python3
"""ESTIMATE (nothing measured on a GPU) of the recurrent layers' decode kernels on H100 and
H200 from the EmuBackend's counters, at real model shapes:

  Qwen3.5-0.8B gated DeltaNet layer: causal_conv1d_update over 6144 channels + gdr_decode
      (16 key / 16 value heads x 128; FP32 state 1 MiB per sequence and layer) + the gated
      RMSNorm of its output (gated_norm.rmsnorm_gated, norm first);
  Nemotron-H-8B Mamba2 layer: causal_conv1d_update over 10240 channels + mamba2_step
      (128 heads x 64, d_state 128, 8 groups; FP32 state 4 MiB per sequence and layer) + its
      gated RMSNorm (silu(z) first, 8 groups).

    python benchmarks/recurrent_estimate.py [--batch 1,8,64] [--json FILE]

Each launch runs on ProfileEmuBackend (sampled blocks above 512) and goes through
gpu_runtime/emu/estimate.py: DRAM bytes from the unique sectors touched, time = 2 us fixed +
max(DRAM, tensor core, shared memory); CUDA-core arithmetic is not counted (a decode step is
bound by its state bytes, so that is the term that matters here). "floor" is the state bytes
(read + written) at the device's HBM bandwidth.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.gpu_runtime.emu import estimate as est  # noqa: E402
from metrale.gpu_runtime.emu.trace import ProfileEmuBackend  # noqa: E402
from metrale.ops import causal_conv1d as cc  # noqa: E402
from metrale.ops import gated_delta_rule as gdr  # noqa: E402
from metrale.ops import gated_norm as gn  # noqa: E402
from metrale.ops import mamba2_ssd as m2  # noqa: E402


def _buf(be, nbytes):
    return be.alloc(int(nbytes))


def _put(be, arr):
    p = be.alloc(arr.nbytes)
    be.copy_h2d(np.ascontiguousarray(arr), p)
    return p


def gdn_layer(be, n):
    Hk, Hv, dk, dv = 16, 16, 128, 128
    C = 2 * Hk * dk + Hv * dv
    slots = _put(be, np.arange(n, dtype=np.int32))
    x, y = _buf(be, n * C * 2), _buf(be, n * C * 2)
    cs, ss = cc.state_elements(C, 4), gdr.state_elements(Hv, dk, dv)
    cc.causal_conv1d_update(be, 0, y, C, x, C, _buf(be, C * 8), 0, _buf(be, n * cs * 2), cs,
                            slots, n, C, 4)
    ab, out, par = _buf(be, n * 2 * Hv * 2), _buf(be, n * Hv * dv * 2), _buf(be, Hv * 4)
    gdr.gdr_decode(be, 0, out, y, y.offset(2 * Hk * dk), y.offset(4 * Hk * dk), C, ab,
                   ab.offset(2 * Hv), 2 * Hv, par, par, _buf(be, n * ss * 4), ss, slots, n, Hk,
                   Hv, dk, dv)
    gn.rmsnorm_gated(be, 0, out, out, _buf(be, n * Hv * dv * 2), _buf(be, dv * 2), n, Hv * dv,
                     dv, dv, Hv * dv, 1e-6, True)
    return n * ss * 4


def mamba_layer(be, n):
    H, G, P, N = 128, 8, 64, 128
    C = H * P + 2 * G * N
    slots = _put(be, np.arange(n, dtype=np.int32))
    x, y = _buf(be, n * C * 2), _buf(be, n * C * 2)
    cs, ss = cc.state_elements(C, 4), m2.state_elements(H, P, N)
    cc.causal_conv1d_update(be, 0, y, C, x, C, _buf(be, C * 8), _buf(be, C * 2),
                            _buf(be, n * cs * 2), cs, slots, n, C, 4)
    dt, out, par = _buf(be, n * H * 2), _buf(be, n * H * P * 2), _buf(be, H * 4)
    m2.mamba2_step(be, 0, out, y, C, y.offset(2 * H * P), y.offset(2 * (H * P + G * N)), C, dt,
                   H, par, par, par, 0.0, float("inf"), _buf(be, n * ss * 4), ss, slots, n, H,
                   G, P, N)
    gn.rmsnorm_gated(be, 0, out, out, _buf(be, n * H * P * 2), _buf(be, H * P * 2), n, H * P,
                     H * P // G, H * P, H * P, 1e-5, False)
    return n * ss * 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    rows = []
    for model, layer in (("qwen3.5-0.8b gated DeltaNet layer", gdn_layer),
                         ("nemotron-h-8b Mamba2 layer", mamba_layer)):
        for n in (int(b) for b in args.batch.split(",")):
            be = ProfileEmuBackend(sample_blocks=16, full_grid=512)
            state = layer(be, n)
            for dev in est.DEVICES:
                recs = [dict(r, estimate=est.launch_estimate(r, dev))
                        for r in be.launch_counters]
                total = sum(r["estimate"]["us"] for r in recs)
                floor = 2 * state / dev.hbm_bytes_per_s * 1e6
                rows.append({"model": model, "batch": n, "device": dev.name,
                             "estimated_us": total, "state_floor_us": floor,
                             "kernels": [{"kernel": r["kernel"],
                                          "grid": r["grid"], **r["estimate"]} for r in recs]})
                ks = ", ".join(f"{k['kernel'].split('.')[-1]} {k['us']:.1f} us ({k['limiter']})"
                               for k in rows[-1]["kernels"])
                print(f"ESTIMATE {dev.name}: {model}, batch {n}: {total:.1f} us "
                      f"(state floor {floor:.1f} us): {ks}")
    if args.json:
        Path(args.json).write_text(json.dumps({"estimate": True, "what": "EmuBackend counters "
                                               "through gpu_runtime/emu/estimate.py; not "
                                               "measured on a GPU", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
