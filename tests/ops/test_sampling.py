"""sampling family: twin against the float64 definition, Philox KATs, chi-square fits, and
(on a GPU) the kernel against the twin."""
from __future__ import annotations

import math

import numpy as np
import pytest

from metrale import MetraleError
from metrale.engine.sampling import SamplingParams, filtered_distribution
from metrale.errors import KernelError
from metrale.ops import argmax
from metrale.ops import sampling as S
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import on_emu, real
from tests.helpers import Buffers

SP = SamplingParams


# --------------------------------------------------------------------------- helpers
def run(backend, rows, params, seeds, steps, penalty=None, fp32=True):
    """Launch sample_rows on `backend`. rows: [n, vocab] float32 (rounded through BF16 by
    the caller when fp32=False matters); params: list of SamplingParams or a PARAMS_DTYPE
    array; penalty: list (one per row) of id lists, or None. Returns [n] uint32."""
    rows = np.asarray(rows, np.float32)
    n, v = rows.shape
    packed = params if isinstance(params, np.ndarray) else S.pack_params(params)
    seeds = np.broadcast_to(np.asarray(seeds, np.uint64), (n,)).copy()
    steps = np.broadcast_to(np.asarray(steps, np.uint64), (n,)).copy()
    with Buffers(backend) as b:
        lp = b.put(rows if fp32 else f32_to_bf16(rows))
        op = b.empty((n,), np.uint32)
        pp, sp, tp = b.put(packed), b.put(seeds), b.put(steps)
        wp = b.empty((S.workspace_bytes(n, v),), np.uint8)
        m, ip, cp = 0, 0, 0
        if penalty is not None:
            m = max(1, max(len(p) for p in penalty))
            ids = np.full((n, m), -1, np.int32)
            for r, p in enumerate(penalty):
                ids[r, :len(p)] = p
            ip = b.put(ids)
            cp = b.put(np.array([len(p) for p in penalty], np.int32))
        S.sample_rows(backend, backend.default_stream(), op, lp, fp32, n, v, pp, sp, tp,
                      ip, cp, m, wp)
        return b.get(op, (n,), np.uint32)


def draw(backend, row, params, n, seed=1234, prev=None, fp32=True, chunk=2000,
         vary_seed=True):
    """n draws from one logits row: rows with steps 0..n-1 and seeds seed + 0..n-1 (or
    one seed)."""
    out = []
    for s0 in range(0, n, chunk):
        c = min(chunk, n - s0)
        rows = np.repeat(np.asarray(row, np.float32)[None], c, 0)
        pen = None if prev is None else [list(prev)] * c
        steps = np.arange(s0, s0 + c, dtype=np.uint64)
        seeds = np.uint64(seed) + (steps if vary_seed else np.uint64(0))
        out.append(run(backend, rows, [params] * c, seeds, steps, pen, fp32))
    return np.concatenate(out)


def gammaincc(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    lg = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(lg))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(lg) * h


def chi2_sf(x: float, df: int) -> float:
    return gammaincc(df / 2.0, x / 2.0)


def chi2_pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of tokens to probs; bins with expected count < 5 are pooled. Any
    draw outside the support gives p = 0."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    small = (~big) & (probs > 0)
    if small.any():
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    df = len(exp_b) - 1
    if df < 1:
        return 1.0
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return chi2_sf(stat, df)


def peaked_row(rng, vocab, n_head=12, boost=10.0):
    """Normal logits plus a few boosted 'head' tokens, so filtered supports stay small."""
    row = rng.normal(size=vocab).astype(np.float32)
    head = rng.choice(vocab, size=min(n_head, vocab), replace=False)
    row[head] += np.float32(boost) + rng.normal(size=head.size).astype(np.float32)
    return row


# --------------------------------------------------------------------------- Philox
KATS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("ctr,key,expected", KATS)
def test_philox_known_answers(ctr, key, expected):
    assert list(S.philox4x32_10(ctr, key)) == expected


def test_philox_vectorised_and_draw_word_layout():
    ctrs = np.array([k[0] for k in KATS], np.uint64)
    keys = np.array([k[1] for k in KATS], np.uint64)
    got = S.philox4x32_10(ctrs, keys)
    assert got.dtype == np.uint32 and got.shape == (3, 4)
    assert got.tolist() == [k[2] for k in KATS]
    # draw_word: counter (step lo, step hi, 0, 0), key (seed lo, seed hi), word 0
    seed, step = 0x299F31D0A4093822, 0x85A308D3243F6A88
    w = S.draw_word([seed], [step])[0]
    assert int(w) == int(S.philox4x32_10([0x243F6A88, 0x85A308D3, 0, 0],
                                         [0xA4093822, 0x299F31D0])[0])
    assert S.draw_word([0], [0])[0] == 0x6627E8D5


def test_uniforms_look_independent_across_steps_and_seeds():
    steps = np.arange(200_000, dtype=np.uint64)
    u = S.uniform(np.full(steps.size, 42, np.uint64), steps)
    assert np.all((u >= 0) & (u < 1))
    assert abs(u.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    v = S.uniform(np.full(steps.size, 43, np.uint64), steps)
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01
    # 16-bin uniformity of the words
    p = chi2_pvalue((u * 16).astype(np.int64), np.full(16, 1 / 16))
    assert p > 1e-3


# --------------------------------------------------------------------------- exp, keys
def test_exp_det_is_accurate_and_exact_at_zero():
    d = np.linspace(-80, 0, 400_001).astype(np.float32)
    e = S.exp_det(d)
    ref = np.exp(d.astype(np.float64))
    assert np.max(np.abs(e - ref) / ref) < 2.5e-7  # ~2 ulp
    assert S.exp_det(np.float32([0.0]))[0] == 1.0
    assert list(S.exp_det(np.float32([-80.5, -1e30, -np.inf]))) == [0, 0, 0]


def test_order_key_orders_floats():
    x = np.float32([-np.inf, -1e30, -2.5, -1e-30, -0.0, 0.0, 1e-30, 3.0, np.inf])
    k = S.order_key(x)
    assert np.all(np.diff(k.astype(np.int64)[[0, 1, 2, 3, 5, 6, 7, 8]]) > 0)
    assert k[4] == k[5]


def test_params_layout():
    assert S.PARAMS_DTYPE.itemsize == 32
    rec = S.pack_params([SP(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1,
                            repetition_penalty=1.3)])
    raw = rec.tobytes()
    assert len(raw) == 32
    f = np.frombuffer(raw[:16], np.float32)
    assert np.allclose(f, [0.5, 0.9, 0.1, 1.3])
    assert np.frombuffer(raw[16:32], np.int32).tolist() == [7, 0, 0, 0]


# --------------------------------------------------------------------------- support
def _cases(vocab):
    cases = [SP(temperature=1.0, top_k=min(5, vocab)),
             SP(temperature=1.0, top_p=0.6),
             SP(temperature=1.0, min_p=0.1),
             SP(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3)]
    if vocab <= 19:
        cases.append(SP(temperature=1.5))
    return cases


@pytest.mark.parametrize("vocab", [1, 7, 19, 111, 4097, 32000])
def test_twin_support_equals_definition(host, vocab):
    rng = np.random.default_rng(vocab)
    row = peaked_row(rng, vocab) if vocab > 19 else rng.normal(size=vocab).astype(np.float32)
    prev = list(rng.choice(vocab, size=min(6, vocab), replace=False)) + [0, 0, vocab + 5, -3]
    n = 400 if vocab >= 4097 else 3000
    for i, p in enumerate(_cases(vocab)):
        pv = prev if p.repetition_penalty != 1 else None
        probs = filtered_distribution(row, p, pv or ())
        support = set(np.nonzero(probs)[0].tolist())
        # the draws below can see every token of the support
        assert min(probs[list(support)]) > 10 / n, (vocab, p)
        got = draw(host, row, p, n, seed=1000 + 7919 * i, prev=pv, chunk=300)
        assert set(got.tolist()) == support, (vocab, p)


@pytest.mark.parametrize("vocab", [7, 111, 4097])
def test_bf16_and_fp32_inputs_agree(host, rng, vocab):
    rows = bf16_to_f32(f32_to_bf16(rng.normal(size=(64, vocab)).astype(np.float32) * 3))
    params = [SP(temperature=[0.0, 0.6, 1.0, 1.7][r % 4], top_k=[0, 3, 40, 0][r % 4],
                 top_p=[1.0, 0.8, 0.95, 0.5][(r // 4) % 4], min_p=[0.0, 0.02][r % 2],
                 repetition_penalty=[1.0, 1.2][(r // 2) % 2]) for r in range(64)]
    prev = [list(rng.integers(0, vocab, size=5)) for _ in range(64)]
    steps = np.arange(64, dtype=np.uint64) * 7919
    a = run(host, rows, params, 99, steps, prev, fp32=True)
    b = run(host, rows, params, 99, steps, prev, fp32=False)
    assert np.array_equal(a, b)
    for r in range(64):
        assert filtered_distribution(rows[r], params[r], prev[r])[a[r]] > 0


# --------------------------------------------------------------------------- greedy
def tie_row(vocab, positions, base=-3.0, peak=5.0):
    row = np.full(vocab, base, np.float32)
    row[list(positions)] = peak
    return row


@pytest.mark.parametrize("fp32", [True, False])
def test_greedy_is_the_argmax_rule_bit_for_bit(host, rng, fp32):
    rows = [tie_row(2048, (1, 2)), tie_row(2048, (5, 1030)), tie_row(2048, (3, 1027))]
    rows += list(rng.integers(-8, 9, size=(5, 2048)).astype(np.float32))
    nan_row = np.full(2048, np.nan, np.float32)
    nan_row[[700, 1200]] = [-2.0, -1.0]
    rows += [nan_row, np.full(2048, -np.inf, np.float32)]
    rows = np.stack(rows)
    n = len(rows)
    # top_k / top_p / min_p / seeds are irrelevant at temperature 0
    params = [SP(temperature=0.0, top_k=r % 3, top_p=[1.0, 0.3][r % 2], seed=r)
              for r in range(n)]
    got = run(host, rows, params, np.arange(n), np.arange(n) * 3, fp32=fp32)
    with Buffers(host) as b:
        lp = b.put(rows if fp32 else f32_to_bf16(rows))
        op = b.empty((n,), np.uint32)
        if fp32:
            argmax.argmax_fp32(host, 0, lp, op, n, 2048)
        else:
            argmax.argmax_bf16_batch(host, 0, lp, op, n, 2048)
        ref = b.get(op, (n,), np.uint32)
    assert got.tolist() == ref.tolist()
    assert got[:3].tolist() == [2, 1030, 3]
    assert got[-2:].tolist() == [1200, 0]
    for r in range(n):
        assert filtered_distribution(rows[r], params[r])[got[r]] == 1.0


def test_repetition_penalty_rule(host):
    # once: 2.0 / 1.02 = 1.96 > 1.9 -> 0; applied three times it would be 1.885 < 1.9
    row = np.float32([2.0, 1.9, -1.0, -1.05])
    g = SP(repetition_penalty=1.02)
    assert run(host, row[None], [g], 0, 0, [[0, 0, 0, 99, -1]])[0] == 0
    assert run(host, row[None], [SP(repetition_penalty=1.1)], 0, 0, [[0]])[0] == 1
    # negative logits are multiplied: -1.0 * 1.1 = -1.1 < -1.05
    row2 = np.float32([-1.0, -1.05, -5.0])
    assert run(host, row2[None], [SP(repetition_penalty=1.1)], 0, 0, [[0]])[0] == 1
    assert run(host, row2[None], [SP(repetition_penalty=1.1)], 0, 0, [[]])[0] == 0
    assert filtered_distribution(row, g, [0, 0, 0])[0] == 1.0
    assert filtered_distribution(row2, SP(repetition_penalty=1.1), [0])[1] == 1.0


# --------------------------------------------------------------------------- exact thresholds
# At temperature 1/ln 2 the logits 0, -1, -2, -2 have weights exp(x - max) exactly 1, 1/2,
# 1/4, 1/4 (the kernel's exp_det and float64 exp alike; -3 would not be exact in float64),
# i.e. probabilities 1/2, 1/4, 1/8, 1/8, so a top_p or min_p threshold can be hit exactly.
# HF's TopPLogitsWarper drops a token whose ascending cumulative probability is <= 1 - top_p
# (whose mass of more probable tokens is >= top_p), MinPLogitsWarper one with p < min_p *
# max p: a token whose mass above is exactly top_p goes, one with p == min_p * max p stays.
BOUNDARY_T = 1 / math.log(2)
BOUNDARY_LOGITS = [-2.0, 0.0, -1.0, -2.0]   # at boundary_slots(vocab), the rest -inf
# (params, kept logits): each case has tokens exactly at its threshold, first or last in
# vocabulary order among the candidates, so the first or last kept token shows the rule
BOUNDARY_CASES = [(SP(temperature=BOUNDARY_T, top_p=0.75), {0.0, -1.0}),
                  (SP(temperature=BOUNDARY_T, top_p=0.5), {0.0}),
                  (SP(temperature=BOUNDARY_T, min_p=0.25), {0.0, -1.0, -2.0}),
                  (SP(temperature=BOUNDARY_T, min_p=0.5), {0.0, -1.0})]


def boundary_slots(vocab):
    """Where the four finite logits sit: the first and the last index, two between."""
    return [0, vocab // 4, vocab // 2, vocab - 1]


def boundary_row(vocab):
    row = np.full(vocab, -np.inf, np.float32)
    row[boundary_slots(vocab)] = BOUNDARY_LOGITS
    return row


def hf_support(logits, p: SamplingParams) -> set:
    """The ids HF's warpers keep, written out in float64 (exact here)."""
    x = np.asarray(logits, np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs > 0
    if p.top_p < 1:
        order = np.argsort(probs, kind="stable")      # ascending
        remove = np.cumsum(probs[order]) <= 1 - p.top_p
        remove[-1] = False                           # min_tokens_to_keep = 1
        keep[order[remove]] = False
    if p.min_p > 0:
        keep &= ~(probs < p.min_p * probs.max())
    return set(np.flatnonzero(keep).tolist())


def boundary_seeds():
    """(seed lo, seed hi) at step 0: draw words below 2^32 / 10 and above 0.99 * 2^32, so
    the draw takes the first kept token in vocabulary order, then the last."""
    seeds = np.arange(4000, dtype=np.uint64)
    words = S.draw_word(seeds, np.zeros_like(seeds))
    return int(seeds[words < 2**32 // 10][0]), int(seeds[words > 0.99 * 2**32][0])


def boundary_batch(vocab):
    """Rows, params, seeds and the expected token of each: every boundary case with the
    seed that takes its first kept token and the one that takes its last."""
    row, slots = boundary_row(vocab), boundary_slots(vocab)
    lo, hi = boundary_seeds()
    rows, params, seeds, want = [], [], [], []
    for p, kept in BOUNDARY_CASES:
        ids = sorted(slots[i] for i, v in enumerate(BOUNDARY_LOGITS) if v in kept)
        for seed, tok in ((lo, ids[0]), (hi, ids[-1])):
            rows.append(row)
            params.append(p)
            seeds.append(seed)
            want.append(tok)
    return np.stack(rows), params, np.array(seeds, np.uint64), want


def test_exact_threshold_weights_are_exact():
    x = (np.float32(BOUNDARY_LOGITS) / np.float32(BOUNDARY_T)).astype(np.float32)
    assert S.exp_det(x - x.max()).tolist() == [0.25, 1.0, 0.5, 0.25]
    probs = filtered_distribution(np.float32(BOUNDARY_LOGITS), SP(temperature=BOUNDARY_T))
    assert probs.tolist() == [0.125, 0.5, 0.25, 0.125]


@pytest.mark.parametrize("case", range(len(BOUNDARY_CASES)))
@pytest.mark.parametrize("vocab", [7, 19, 111, 4097])
def test_exact_thresholds_keep_what_hf_keeps(vocab, case):
    p, kept = BOUNDARY_CASES[case]
    row, slots = boundary_row(vocab), boundary_slots(vocab)
    want = {slots[i] for i, v in enumerate(BOUNDARY_LOGITS) if v in kept}
    assert hf_support(row, p) == want
    assert set(np.flatnonzero(filtered_distribution(row, p)).tolist()) == want


@pytest.mark.parametrize("fp32", [True, False])
@pytest.mark.parametrize("vocab", [7, 19, 111, 4097])
def test_twin_exact_thresholds(host, vocab, fp32):
    rows, params, seeds, want = boundary_batch(vocab)
    got = run(host, rows, params, seeds, 0, fp32=fp32)
    assert got.tolist() == want
    for r in range(len(rows)):
        assert kernel_transcription(rows[r], params[r], seeds[r], 0) == want[r]


# --------------------------------------------------------------------------- seeding
def test_seeded_reproducibility(host, rng):
    vocab = 111
    row = rng.normal(size=vocab).astype(np.float32)
    p = SP(temperature=1.0)
    rows = np.repeat(row[None], 400, 0)
    steps = np.arange(400, dtype=np.uint64)
    a = run(host, rows, [p] * 400, 5, steps)
    b = run(host, rows, [p] * 400, 5, steps)
    assert np.array_equal(a, b)
    # the same (seed, step) gives the same token at any batch position
    c = run(host, rows[:50], [p] * 50, 5, steps[::-1][:50])
    assert np.array_equal(c, a[::-1][:50])
    # different steps: many distinct tokens, and consecutive draws are not tied together
    assert len(set(a.tolist())) > 60
    probs = filtered_distribution(row, p)
    same = np.mean(a[1:] == a[:-1])
    assert same < 3 * float((probs ** 2).sum()) + 0.02
    # another seed gives a different sequence
    d = run(host, rows, [p] * 400, 6, steps)
    assert np.mean(a == d) < 0.2


def test_all_masked_row_and_infinities(host):
    ninf = np.full((1, 9), -np.inf, np.float32)
    assert run(host, ninf, [SP(temperature=1.0)], 1, 1)[0] == 0
    row = np.float32([0.0, np.inf, 3.0, np.inf, np.nan])
    got = {int(run(host, row[None], [SP(temperature=1.0)], 3, s)[0]) for s in range(64)}
    assert got == {1, 3}
    nanrow = np.float32([np.nan, 1.0, np.nan, 1.0])
    got = {int(run(host, nanrow[None], [SP(temperature=1.0)], 3, s)[0]) for s in range(64)}
    assert got == {1, 3}


def test_graph_replay_reads_buffers(host, rng):
    """Per-step values come from device buffers: a captured launch picks up new steps."""
    vocab, n = 97, 8
    rows = rng.normal(size=(n, vocab)).astype(np.float32)
    params = S.pack_params([SP(temperature=1.0, top_p=0.9)] * n)
    seeds = np.arange(n, dtype=np.uint64)
    with Buffers(host) as b:
        lp, op = b.put(rows), b.empty((n,), np.uint32)
        pp, sp = b.put(params), b.put(seeds)
        tp = b.put(np.zeros(n, np.uint64))
        wp = b.empty((S.workspace_bytes(n, vocab),), np.uint8)
        host.begin_capture(0)
        S.sample_rows(host, 0, op, lp, True, n, vocab, pp, sp, tp, 0, 0, 0, wp)
        g = host.end_capture(0)
        for step in (3, 11):
            host.copy_h2d(np.full(n, step, np.uint64), tp)
            host.launch_graph(g, 0)
            got = b.get(op, (n,), np.uint32)
            assert np.array_equal(got, S.sample_host(rows, params, seeds,
                                                     np.full(n, step, np.uint64)))
        host.destroy_graph(g)


def test_bad_arguments_raise_before_launch(host):
    with pytest.raises(MetraleError, match="vocab"):
        S.sample_rows(host, 0, 8, 8, True, 1, 0, 8, 8, 8, 0, 0, 0, 8)
    with pytest.raises(MetraleError, match="vocab"):
        S.sample_rows(host, 0, 8, 8, True, 1, S.MAX_VOCAB + 1, 8, 8, 8, 0, 0, 0, 8)
    with pytest.raises(MetraleError, match="n_rows"):
        S.sample_rows(host, 0, 8, 8, True, 0, 10, 8, 8, 8, 0, 0, 0, 8)
    with pytest.raises(MetraleError, match="penalty_ids_ptr"):
        S.sample_rows(host, 0, 8, 8, True, 1, 10, 8, 8, 8, 0, 0, 4, 8)
    with pytest.raises(MetraleError, match="workspace_ptr"):
        S.sample_rows(host, 0, 8, 8, True, 1, 10, 8, 8, 8, 0, 0, 0, 0)


def test_short_workspace_fails_loudly(host):
    with Buffers(host) as b:
        lp, op = b.put(np.zeros((2, 50), np.float32)), b.empty((2,), np.uint32)
        pp = b.put(S.pack_params([SP(temperature=1.0)] * 2))
        sp, tp = b.put(np.zeros(2, np.uint64)), b.put(np.zeros(2, np.uint64))
        wp = b.empty((S.workspace_bytes(2, 50) - 4,), np.uint8)
        with pytest.raises(KernelError):
            S.sample_rows(host, 0, op, lp, True, 2, 50, pp, sp, tp, 0, 0, 0, wp)


# --------------------------------------------------------------------------- chi-square
def test_chi2_sf_against_table():
    # upper critical values of the chi-square distribution (standard tables)
    for x, df, p in [(10.828, 1, 1e-3), (3.841, 1, 0.05), (11.070, 5, 0.05),
                     (29.588, 10, 1e-3), (59.703, 30, 1e-3), (2.558, 10, 0.99),
                     (124.342, 100, 0.05)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3, abs=1e-6)


DIST_VOCAB = 50
DIST_CASES = {
    "temperature_0.5": SP(temperature=0.5),
    "temperature_2": SP(temperature=2.0),
    "top_k": SP(temperature=1.0, top_k=8),
    "top_p": SP(temperature=1.0, top_p=0.7),
    "min_p": SP(temperature=1.0, min_p=0.15),
    "penalty": SP(temperature=1.0, repetition_penalty=1.8),
    "combo": SP(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
}


def _dist_row():
    return (np.random.default_rng(2024).normal(size=DIST_VOCAB) * 1.5).astype(np.float32)


PREV = [3, 3, 17, 41, 0, 49]


@pytest.mark.parametrize("name", list(DIST_CASES))
def test_twin_distribution_chi_square(host, name):
    p = DIST_CASES[name]
    row = _dist_row()
    prev = PREV if p.repetition_penalty != 1 else None
    tokens = draw(host, row, p, 20_000, seed=77, prev=prev, chunk=20_000)
    probs = filtered_distribution(row, p, prev or ())
    assert 3 <= np.count_nonzero(probs)  # a real distribution, not a point mass
    assert chi2_pvalue(tokens, probs) > 1e-3, name


@pytest.mark.parametrize("wrong", ["other_temperature", "no_penalty", "no_top_p"])
def test_chi_square_rejects_a_wrong_distribution(host, wrong):
    """Negative control: the same test must reject a close but wrong distribution."""
    row = _dist_row()
    if wrong == "other_temperature":
        p, q, prev = SP(temperature=1.0), SP(temperature=1.15), None
    elif wrong == "no_penalty":
        p, q, prev = SP(temperature=1.0, repetition_penalty=1.3), SP(temperature=1.0), PREV
    else:
        p, q, prev = SP(temperature=1.0, top_p=0.9), SP(temperature=1.0), None
    tokens = draw(host, row, p, 20_000, seed=78, prev=prev, chunk=20_000)
    assert chi2_pvalue(tokens, filtered_distribution(row, p, prev or ())) > 1e-3
    assert chi2_pvalue(tokens, filtered_distribution(row, q, ())) < 1e-3


def test_chi_square_rejects_numpy_draws_from_wrong_probs():
    rng = np.random.default_rng(5)
    probs = filtered_distribution(_dist_row(), SP(temperature=1.0))
    good = rng.choice(DIST_VOCAB, size=20_000, p=probs)
    assert chi2_pvalue(good, probs) > 1e-3
    bent = probs.copy()
    bent[np.argmax(probs)] *= 0.85
    bent /= bent.sum()
    bad = rng.choice(DIST_VOCAB, size=20_000, p=bent)
    assert chi2_pvalue(bad, probs) < 1e-3


# --------------------------------------------------------------------------- GPU
def _gpu_case(rng, vocab, n):
    rows = (rng.normal(size=(n, vocab)) * 2.5).astype(np.float32)
    heads = rng.integers(0, vocab, size=(n, 16))
    for r in range(n):
        rows[r, heads[r]] += 8
    rows = bf16_to_f32(f32_to_bf16(rows))
    params = []
    for r in range(n):
        kind = r % 8
        params.append([
            SP(temperature=0.0),
            SP(temperature=1.0),
            SP(temperature=0.7, top_k=40),
            SP(temperature=1.0, top_p=0.9),
            SP(temperature=1.2, min_p=0.05),
            SP(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.2),
            SP(temperature=0.0, repetition_penalty=1.5),
            SP(temperature=1.0, top_k=vocab - 1, top_p=0.999),
        ][kind])
    prev = [list(rng.integers(0, vocab, size=int(rng.integers(0, 40)))) + list(heads[r, :2])
            for r in range(n)]
    return rows, params, prev


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [7, 111, 4097, real(32000), real(128256), real(151936)])
@pytest.mark.parametrize("fp32", [True, False])
def test_gpu_matches_twin(device, host, rng, vocab, fp32):
    n = 16 if on_emu(device) else 48  # every one of the 8 parameter kinds, twice
    rows, params, prev = _gpu_case(rng, vocab, n)
    seeds = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    steps = rng.integers(0, 2**40, size=n, dtype=np.uint64)
    greedy = np.array([p.is_greedy for p in params])
    for trial in range(2):
        st = steps + np.uint64(trial)
        g = run(device, rows, params, seeds, st, prev, fp32)
        h = run(host, rows, params, seeds, st, prev, fp32)
        assert np.array_equal(g[greedy], h[greedy])
        assert np.mean(g != h) <= 1e-3, np.nonzero(g != h)


@pytest.mark.gpu
def test_gpu_distribution_matches_twin(device, host):
    row = _dist_row()
    p = DIST_CASES["combo"]
    n = 300 if on_emu(device) else 20_000
    g = draw(device, row, p, n, seed=9, prev=PREV, chunk=n)
    h = draw(host, row, p, n, seed=9, prev=PREV, chunk=n)
    assert np.mean(g != h) <= 1e-3
    assert chi2_pvalue(g, filtered_distribution(row, p, PREV)) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [7, 19, 111, 4097])
@pytest.mark.parametrize("fp32", [True, False])
def test_gpu_exact_thresholds_and_negative_rows_match_twin(device, host, rng, vocab, fp32):
    """The exact top_p / min_p boundaries (tokens known), then rows with no positive logit:
    greedy (the argmax floor, -1e30 with index 0) and sampled (the row max far below 0)."""
    rows, params, seeds, want = boundary_batch(vocab)
    got = run(device, rows, params, seeds, 0, fp32=fp32)
    assert got.tolist() == want
    neg = bf16_to_f32(f32_to_bf16(rng.uniform(-300, -290, (4, vocab)).astype(np.float32)))
    neg[0, 0] = neg[1, 0] = -300   # not the argmax
    p = [SP(temperature=0.0), SP(temperature=0.0), SP(temperature=1.0), SP(temperature=1.0)]
    g = run(device, neg, p, [3, 4, 5, 6], [7, 8, 9, 10], fp32=fp32)
    assert np.array_equal(g, run(host, neg, p, [3, 4, 5, 6], [7, 8, 9, 10], fp32=fp32))
    assert g[0] != 0 and g[1] != 0


# --------------------------------------------------------------------------- kernel algorithm
def kernel_transcription(logits, p, seed, step, prev=()):
    """The kernel's own algorithms for one row, step by step: 8-bit radix select for top_k,
    binary search with block sums for top_p, per-warp segments and a walk for the draw. The
    twin uses sorts instead; both must pick the same token."""
    l = np.asarray(logits, np.float32)
    vocab = l.size
    t = np.float32(p.temperature)
    greedy = not t > 0
    x = l.copy() if greedy else l / t
    pen = np.float32(p.repetition_penalty)
    if pen != 1:
        for i in prev:
            if 0 <= i < vocab:
                lp = l[i] / pen if l[i] > 0 else l[i] * pen
                x[i] = lp if greedy else np.float32(lp) / t
    x = np.where(np.isnan(x), np.float32(-np.inf), x).astype(np.float32)
    if greedy:
        return int(argmax.argmax_rule(x[None])[0])
    xmax = x.max()
    if xmax == -np.inf:
        return 0
    keys = S.order_key(x).astype(np.int64)
    kkey = 0
    k = min(p.top_k, 2**31 - 1)
    if 0 < k < vocab:
        prefix, mask, remaining = 0, 0, k
        for shift in (24, 16, 8, 0):
            match = (keys & mask) == prefix
            hist = np.bincount((keys[match] >> shift) & 255, minlength=256)
            above = 0
            for d in range(255, -1, -1):
                if above + hist[d] >= remaining:
                    break
                above += hist[d]
            prefix |= d << shift
            mask |= 255 << shift
            remaining -= above
        kkey = prefix
    e = np.zeros(vocab, np.float32)
    kept_k = keys >= kkey
    e[kept_k] = S.exp_det((x[kept_k] - xmax).astype(np.float32))
    e[kept_k & (x == xmax)] = 1
    q = (e * np.float32(2.0 ** 44)).astype(np.uint64)
    bits = e.view(np.uint32).astype(np.int64)
    z = int(q.sum())
    pkey = 0
    if np.float32(p.top_p) < 1:
        limit = float(z) * float(np.float32(p.top_p))
        lo, hi = 0, 0x3F800001
        while hi - lo > 1:
            mid = lo + ((hi - lo) >> 1)
            f = int(q[bits >= mid].sum())
            if float(f) < limit:
                hi = mid
            else:
                lo = mid
        pkey = lo
    mp = min(np.float32(p.min_p), np.float32(1)) if p.min_p > 0 else np.float32(0)
    w = np.where((bits >= pkey) & (e >= mp), q, np.uint64(0))
    seg = ((vocab + 31) // 32 + 31) & ~31
    sums = [int(w[i * seg:(i + 1) * seg].sum()) for i in range(32)]
    zf = sum(sums)
    rnd = int(S.draw_word([seed], [step])[0])
    target = (zf * rnd) >> 32
    before = 0
    for wi in range(32):
        if before <= target < before + sums[wi]:
            acc = before
            for base in range(wi * seg, min(vocab, (wi + 1) * seg), 32):
                chunk = [int(v) for v in w[base:min(base + 32, vocab, (wi + 1) * seg)]]
                incl = np.cumsum(chunk)
                hit = np.nonzero(acc + incl > target)[0]
                if hit.size:
                    return base + int(hit[0])
                acc += int(incl[-1])
        before += sums[wi]
    raise AssertionError("no token found")


@pytest.mark.parametrize("vocab", [1, 7, 33, 1500, 5000])
def test_kernel_algorithms_match_twin(host, vocab):
    rng = np.random.default_rng(vocab + 11)
    n = 40
    rows = rng.integers(-6, 7, size=(n, vocab)).astype(np.float32)  # many exact ties
    rows[::3] = rng.normal(size=(len(rows[::3]), vocab)).astype(np.float32) * 4
    rows[5, : vocab // 2] = -np.inf
    params = []
    for r in range(n):
        params.append(SP(temperature=[0.0, 0.5, 1.0, 2.0, 1e-3][r % 5],
                         top_k=[0, 1, 3, 17, vocab, 2**40][r % 6],
                         top_p=[1.0, 0.5, 0.9, 1e-6, 0.999][(r // 2) % 5],
                         min_p=[0.0, 0.3, 1.0, 0.01][(r // 3) % 4],
                         repetition_penalty=[1.0, 1.5, 0.7][(r // 4) % 3]))
    prev = [list(rng.integers(-2, vocab + 2, size=int(rng.integers(0, 9)))) for _ in range(n)]
    seeds = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    steps = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    got = run(host, rows, params, seeds, steps, prev)
    for r in range(n):
        ref = kernel_transcription(rows[r], params[r], seeds[r], steps[r], prev[r])
        assert got[r] == ref, (r, params[r])
