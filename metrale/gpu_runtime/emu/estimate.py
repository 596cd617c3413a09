"""An ESTIMATE of a kernel launch's time on H100 and H200 from the EmuBackend's counters
(counters.h) and the NVRTC register and shared-memory figures: nothing here was measured on
a GPU. Every number this module produces is labelled an estimate.

Per launch (a grid of G blocks of which S ran, so per-block counts scale by G / S):
  DRAM bytes   per allocation the launch touches: the unique 32-byte sectors its blocks read
               (and, separately, wrote) x 32 x G / S, at most the allocation's size. Data
               read by several blocks counts once (L2 hits), data every block reads alone
               scales with the grid;
  t_dram     = DRAM bytes / (HBM bandwidth x min(1, G / SMs)): a grid smaller than the GPU
               draws at most its SMs' share of the bandwidth;
  t_tensor   = mma.sync count x G / S x 4096 FLOP / dense BF16 tensor-core peak (an
               optimistic bound: mma.sync reaches less of it than wgmma does);
  t_shared   = shared-memory wavefronts (loads, stores, ldmatrix; conflicts included) x G / S
               / (min(G, SMs) x one wavefront per SM clock);
  time       = FIXED_US + max(t_dram, t_tensor, t_shared), and the limiter is the largest
               term ("launch" when FIXED_US is larger than all three).
FIXED_US stands for what a kernel costs beyond its work inside a CUDA graph (launch, block
dispatch, first-access DRAM latency, the last wave's tail); it is an assumed figure, not a
measurement, and the estimate also gives every step's time without it.
CUDA-core arithmetic and instruction issue are not counted: a kernel limited by FP32 math
(e.g. prefill attention without tensor cores) is underestimated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

FIXED_US = 2.0
MMA_FLOP = 2 * 16 * 8 * 16   # one mma.sync.m16n8k16


@dataclass(frozen=True)
class Device:
    """Published figures (NVIDIA data sheets, SXM parts)."""
    name: str
    hbm_bytes_per_s: float
    tensor_bf16_flops: float      # dense
    sms: int
    clock_hz: float               # boost
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32


H100 = Device("H100 SXM (estimate)", 3.35e12, 989e12, 132, 1.98e9)
H200 = Device("H200 SXM (estimate)", 4.8e12, 989e12, 132, 1.98e9)
DEVICES = (H100, H200)


def occupancy(dev: Device, threads: int, registers: int | None, smem_bytes: int) -> dict:
    """Blocks per SM from registers (allocated per warp in units of 256), shared memory (1 KiB
    reserved per block) and threads; None figures are left out."""
    warps = -(-threads // 32)
    limits = {"threads": dev.threads_per_sm // max(threads, 1), "blocks": dev.blocks_per_sm}
    if registers:
        per_warp = -(-registers * 32 // 256) * 256
        limits["registers"] = dev.regs_per_sm // (per_warp * warps)
    limits["shared memory"] = dev.smem_per_sm // (smem_bytes + 1024)
    blocks = max(0, min(limits.values()))
    limiter = min(limits, key=limits.get)
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limited_by": limiter}


def dram_bytes(counters: dict, scale: float) -> tuple[float, float]:
    """(bytes read, bytes written) from DRAM, see the module docstring."""
    rd = wr = 0.0
    for r in counters["ranges"]:
        rd += min(r["size"], r["ld_sectors"] * 32 * scale)
        wr += min(r["size"], r["st_sectors"] * 32 * scale)
    return rd, wr


def launch_estimate(rec: dict, dev: Device) -> dict:
    """Estimated microseconds of one launch record (EmuBackend.launch_counters) on `dev`."""
    c = rec["counters"]
    grid = rec["grid"][0] * rec["grid"][1] * rec["grid"][2]
    scale = grid / max(c["blocks"], 1)
    rd, wr = dram_bytes(c, scale)
    share = min(1.0, grid / dev.sms)
    t_dram = (rd + wr) / (dev.hbm_bytes_per_s * share) * 1e6
    flops = c["mma"] * scale * MMA_FLOP
    t_tc = flops / dev.tensor_bf16_flops * 1e6
    wavefronts = (c["sld_wavefronts"] + c["sst_wavefronts"] + c["ldsm_wavefronts"]) * scale
    t_smem = wavefronts / (min(grid, dev.sms) * dev.clock_hz) * 1e6
    terms = {"DRAM": t_dram, "tensor core": t_tc, "shared memory": t_smem}
    limiter = max(terms, key=terms.get)
    if terms[limiter] < FIXED_US:
        limiter = "launch"
    return {"us": FIXED_US + max(terms.values()), "work_us": max(terms.values()),
            "limiter": limiter, "dram_read": rd, "dram_written": wr, "flops": flops,
            **{f"{k.replace(' ', '_')}_us": v for k, v in terms.items()}}


def efficiency(c: dict) -> dict:
    """Coalescing and bank-conflict ratios of counters (or sums of them)."""
    def ratio(a, b):
        return a / b if b else None
    return {
        "gld_sector_efficiency": ratio(c["gld_ideal"], c["gld_sectors"]),
        "gst_sector_efficiency": ratio(c["gst_ideal"], c["gst_sectors"]),
        "gld_bytes_requested": c["gld_bytes"], "gld_bytes_unique_per_request": c["gld_unique"],
        "gld_sectors_per_request": ratio(c["gld_sectors"], c["gld_requests"]),
        "shared_bank_conflicts": (c["sld_wavefronts"] - c["sld_ideal"]
                                  + c["sst_wavefronts"] - c["sst_ideal"]),
        "ldmatrix_bank_conflicts": c["ldsm_wavefronts"] - c["ldsm_ideal"],
    }


def device_dict(dev: Device) -> dict:
    return asdict(dev)
