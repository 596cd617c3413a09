#!/usr/bin/env python3
"""How far each CUDA kernel (run by the EmuBackend) and its numpy twin (run by the
HostBackend) are apart, on real workloads: every launch runs both and compares the outputs.

    python benchmarks/emu_vs_twin.py [--json FILE]

Workloads: the five decoder fixtures (prefill, chunked prefill, decode, decode_batch, verify,
FP32 logits, sampled and greedy generation), Whisper (encoder, decoder, transcribe), LLaVA
(CLIP tower, image-spliced prefill), random-weight models at head shapes that reach every
attention variant, and direct launches of the casts, the argmaxes, dense attention, the
scalar conv1d path, rope and the KV cache write as separate launches, every gemm_tc tile and
the GEMV. Per kernel: launches, elements compared, how many differ, the largest difference
in units in the last place (BF16 or FP32; also over the elements at least 1/256 of the
largest, since near zero a sign flip of two tiny values counts as a huge ulp distance) and
relative to the largest value, and every entry point that no workload reached.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import metrale  # noqa: E402
from metrale.engine import SamplingParams, generate  # noqa: E402
from metrale.engine.transcribe import transcribe  # noqa: E402
from metrale.gpu_runtime import kernel_source  # noqa: E402
from metrale.gpu_runtime.emu import EmuBackend  # noqa: E402
from metrale.model_engine import PrefillSlice  # noqa: E402
from metrale.ops import argmax, cast, gemm, gemm_tc  # noqa: E402
from metrale.ops.conv1d import conv1d  # noqa: E402
from metrale.ops.dense_attention import dense_attention  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
DECODERS = ["llama_gqa", "llama_mqa_tied", "mistral", "qwen2", "qwen3"]


def golden(name: str) -> dict:
    with np.load(FIXTURES / name / "golden.npz") as g:
        return {k: g[k] for k in g.files}


def decoder_workload(be, name: str) -> None:
    ids = golden(name)["input_ids"][0].tolist()
    for fp32 in (False, True):
        m = metrale.load(FIXTURES / name, be, progress=False, fp32_logits=fp32, graphs=fp32)
        s = m.default_stream()
        seq = m.alloc_sequence()
        m.prefill_chunk(ids[:12], seq, 0, 5, False, s)
        m.prefill_chunk(ids[:12], seq, 5, 7, True, s)
        for t in ids[12:18]:
            m.decode(t, seq, s)
        m.decode_verify(ids[18:22], seq, s)
        seqs = []
        for n in (3, 9, 14):
            q = m.alloc_sequence()
            m.prefill(ids[:n], q, s)
            seqs.append(q)
        m.decode_batch([ids[n] for n in (3, 9, 14)], seqs, s)
        m.mixed_forward_batch([ids[3]], [seqs[0]], [PrefillSlice(ids[:10], m.alloc_sequence(),
                                                                 0, 10, True)], s)
        generate(m, ids[:6], 6, SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                               repetition_penalty=1.2, seed=3),
                 stop_token_ids=[])
        m.teardown()


def whisper_workload(be) -> None:
    g = golden("whisper_tiny")
    m = metrale.load(FIXTURES / "whisper_tiny", be, progress=False)
    try:
        enc = m.encode_audio(g["mel"])
        m.decode_step(g["decoder_input_ids"][0].tolist(), enc)
        transcribe(m, g["audio"], max_new_tokens=4)
    finally:
        m.close()


def llava_workload(be) -> None:
    g = golden("llava_tiny")
    m = metrale.load(FIXTURES / "llava_tiny", be, progress=False)
    s = m.default_stream()
    feats = m.encode_images([g["pixel_values"]], s)
    ids = g["input_ids"][0].tolist()
    seq = m.alloc_sequence()
    m.prefill_multimodal(ids, feats, seq, s)
    m.decode(ids[-1], seq, s)


# (heads, kv heads, head_dim): together with the fixtures these reach every prefill kernel
# (tensor-core head dims 16..256; CUDA-core p1/p2/p4 for the others) and every decode one
# (v8/v2 x g1/g2/g4/g8); 300-token prompts make decode split-K.
HEAD_SHAPES = [(4, 4, 256), (8, 1, 18), (6, 2, 96), (4, 2, 6), (16, 2, 64), (2, 2, 10),
               (8, 2, 10), (2, 2, 80), (4, 1, 128), (2, 2, 66), (2, 1, 200)]


def head_shapes_workload(be) -> None:
    from metrale.formats import MemorySource, preset_config
    rng = np.random.default_rng(1)
    for h, kv, d in HEAD_SHAPES:
        cfg = dict(preset_config("tiny")[0], num_attention_heads=h, num_key_value_heads=kv,
                   head_dim=d, num_hidden_layers=1, hidden_size=64, intermediate_size=96)
        m = metrale.load(MemorySource.from_config(cfg), be, progress=False)
        s = m.default_stream()
        ids = rng.integers(3, 500, 310).tolist()
        seq = m.alloc_sequence()
        m.prefill(ids[:300], seq, s)
        for t in ids[300:303]:
            m.decode(t, seq, s)
        m.teardown()


def direct_workload(be) -> None:
    rng = np.random.default_rng(0)
    s = be.default_stream()
    x = (rng.standard_normal(4097) * 3).astype(np.float32)
    xp, bp, fp = be.alloc(x.nbytes), be.alloc(4097 * 2), be.alloc(x.nbytes)
    be.copy_h2d(x, xp)
    cast.f32_to_bf16(be, s, bp, xp, 4097)
    cast.bf16_to_f32(be, s, fp, bp, 4097)
    rows = np.round(rng.standard_normal((5, 1000)) * 4).astype(np.float32)
    lp, mp, op = be.alloc(5 * 1000 * 2), None, be.alloc(5 * 4)
    be.copy_h2d(cast_bits(rows), lp)
    packed = argmax.pack_masks([[1, 2], [], [int(np.argmax(rows[2]))], [0] * 8, [999]], 1000)
    mp = be.alloc(packed.nbytes)
    be.copy_h2d(packed, mp)
    argmax.argmax_bf16_batch_masked(be, s, lp, mp, op, 5, 1000, 1000)
    argmax.argmax_bf16(be, s, lp, op, 1000)
    ptrs = [xp, bp, fp, lp, mp, op]
    for d in (96, 256, 6, 66, 130):  # dense attention: p1/p2/p4 x 128-bit / 32-bit loads
        q = cast_bits(rng.standard_normal((40, 2 * d)).astype(np.float32))
        qp, out = be.alloc(q.nbytes), be.alloc(q.nbytes)
        be.copy_h2d(q, qp)
        dense_attention(be, s, out, qp, qp, qp, 40, 40, 2, 2, d, 2 * d, 2 * d, d ** -0.5, True)
        ptrs += [qp, out]
    xc = cast_bits(rng.standard_normal((50, 5)).astype(np.float32))  # odd channels: v1 path
    wc = cast_bits(rng.standard_normal((7, 3, 5)).astype(np.float32) * 0.2)
    bc = cast_bits(rng.standard_normal(7).astype(np.float32))
    cx, cw, cb, co = (be.alloc(a.nbytes) for a in (xc, wc, bc, xc))
    for a, p in ((xc, cx), (wc, cw), (bc, cb)):
        be.copy_h2d(a, p)
    conv1d(be, s, co, cx, cw, cb, 5, 7, 50, 3, 2, 1, True)
    ptrs += [cx, cw, cb, co]
    # rope and the cache write as separate launches (the models use rope_write_kv), with a
    # q/k norm and a padding slot
    from metrale.ops import kv_cache, rope
    h, kv, d, n = 4, 2, 64, 7
    qkv = cast_bits(rng.standard_normal((n, (h + 2 * kv) * d)).astype(np.float32))
    table = rope.rope_table(d, 64, 10000.0, None)
    norm_w = cast_bits(rng.uniform(0.5, 1.5, d).astype(np.float32))
    pos, slots = np.arange(n, dtype=np.int32) * 5, np.array([3, 0, -1, 9, 1, 4, 2], np.int32)
    rq, rt, rp, rs, rn = (be.alloc(a.nbytes) for a in (qkv, table, pos, slots, norm_w))
    for a, p in ((qkv, rq), (table, rt), (pos, rp), (slots, rs), (norm_w, rn)):
        be.copy_h2d(a, p)
    kc, vc = be.alloc(16 * kv * d * 2), be.alloc(16 * kv * d * 2)
    be.memset(kc, 0, 16 * kv * d * 2)
    be.memset(vc, 0, 16 * kv * d * 2)
    rope.apply_rope(be, s, rq, rp, rt, n, h, kv, d, 64, rn, rn, 1e-6)
    kv_cache.write_kv(be, s, rq, kc, vc, rs, n, h, kv, d)
    ptrs += [rq, rt, rp, rs, rn, kc, vc]
    # GEMMs: every gemm_tc tile (the models reach only some), ragged k (scalar path), and
    # the CUDA-core GEMV the model no longer uses (kept as a reference)
    for m, n, k in ((33, 70, 264), (130, 37, 19)):
        xg = cast_bits(rng.standard_normal((m, k)).astype(np.float32))
        wg = cast_bits((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        xgp, wgp = be.alloc(xg.nbytes), be.alloc(wg.nbytes)
        y16, y32 = be.alloc(m * n * 2), be.alloc(m * n * 4)
        be.copy_h2d(xg, xgp)
        be.copy_h2d(wg, wgp)
        for tile in gemm_tc.TILES:
            gemm_tc.gemm_tc(be, s, y16, xgp, wgp, m, n, k, tile=tile)
            gemm_tc.gemm_tc(be, s, y32, xgp, wgp, m, n, k, out_fp32=True, tile=tile)
        gemm.gemv(be, s, y16, xgp, wgp, m, n, k)
        gemm.gemv(be, s, y32, xgp, wgp, m, n, k, out_fp32=True)
        ptrs += [xgp, wgp, y16, y32]
    for p in ptrs:
        be.free(p)


def cast_bits(a: np.ndarray) -> np.ndarray:
    from metrale.ops.bf16 import f32_to_bf16
    return f32_to_bf16(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    be = EmuBackend(check_twins=True)
    for name in DECODERS:
        decoder_workload(be, name)
    whisper_workload(be)
    llava_workload(be)
    head_shapes_workload(be)
    direct_workload(be)
    rep = be.twin_agreement()
    reached = set(rep)
    unreached = [f"{f.stem}.{n}" for f in kernel_source.kernel_files()
                 for n in kernel_source.entry_points(f.stem) if f"{f.stem}.{n}" not in reached]
    for k, v in rep.items():
        verdict = ("bit-exact" if v["bit_exact"] else
                   f"{v['differing']} of {v['elements']} differ, max {v['max_ulps']} ulp "
                   f"({v['max_ulps_large']} away from 0), max |diff| {v['max_rel_diff']:.1e} "
                   "of max |value|")
        if not v["elements"]:
            verdict = "wrote only its own scratch space"
        print(f"{k:<42} {v['launches']:>6} launches  {'/'.join(v['types']) or '-':<5} {verdict}")
    print(f"not reached by these workloads: {', '.join(unreached) or 'none'}")
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/emu_vs_twin.py" + (f" --json {args.json}"),
            "device": "EmuBackend (g++ build of kernels/*.cu) vs HostBackend twins, CPU",
            "kernels": rep, "unreached": unreached,
            "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
