"""The tiny preset's prefill, decode_batch and decode_verify on the GPU: the workload that
tests/reliability/test_sanitizer.py runs under compute-sanitizer (memcheck, racecheck)."""
from __future__ import annotations

import sys

import metrale


def main() -> int:
    m = metrale.load("preset:tiny", "cuda", kv_blocks=64, max_batch=8, progress=False,
                     graphs=False)
    s = m.default_stream()
    seqs = [m.alloc_sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):
        m.prefill(list(range(5, 5 + 7 + 13 * i)), seq, s)
    m.decode_batch([7, 8, 9], seqs, s)
    m.decode_verify([3, 4, 5, 6], seqs[0], s)
    m.argmax_batch(m.logits_buffer_ptr(), 3, s)
    m.synchronize(s)
    for seq in seqs:
        m.free_sequence(seq)
    m.teardown()
    print("sanitize workload done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
