"""The gated DeltaNet layer pass of the hybrid decoders (formats/hybrid_config.py has the
math, hybrid_weights.py the device layout), and the per-step host plan of the recurrent
layers (`RecurrentStep`, staged by hybrid.py before the layers run).

    proj = x @ in_proj^T, ab = x @ in_proj_ab^T     [n, q | k | v | z], [n, b | a]
    qkv  = silu(causal_conv1d(q | k | v))    with the conv window of each sequence's slot
    o    = gated_delta_rule(q, k, v, a, b)   with its FP32 state (g, beta, L2 norms inside)
    o    = rmsnorm(o) * w * silu(z)          per value head (gated_norm, norm first)
    out  = o @ out_proj^T                    -> ws.hidden
A prefill runs the chunked kernels over the pass's ragged batch (cu_seqlens = the attention's
qo_indptr, start_pos = each sequence's cached length: 0 reads no state). A decode step runs
the one-token kernels over every row at once, each row its sequence's slot (padding rows the
pool's sink). Rows of one sequence (a verify) run one at a time, in order, each exactly a
decode step, and the state after each row is kept in the pool's verify slots (the original's
per-token intermediates).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import causal_conv1d, gated_delta_rule, gated_norm
from .linear import run_linear


@dataclass
class RecurrentStep:
    """What the recurrent layers of one forward pass do (host side)."""

    decode: bool
    n_seqs: int = 0            # prefill: sequences in the pass
    max_len: int = 1           # prefill: the longest chunk (sizes the conv's grid)
    # decode rows run one at a time (a verify); empty: every row at once. Per row:
    # (slot, verify slot to fill before the row or -1, verify slot to fill after it or -1)
    sequential: list[tuple[int, int, int]] = field(default_factory=list)


def run_recurrent(model, stream: int, li: int, n: int, kernels) -> None:
    """Run a recurrent layer's kernels over the step's rows: `kernels(row, rows, slots_ptr,
    decode)` launches them for `rows` rows from `row`, whose slots are at slots_ptr. A
    prefill and a decode step run every row at once; a verify runs its rows one by one,
    keeping the state before its first row and after each row in the verify slots (layer
    `li` of the state arena)."""
    hb, arena, step = model._hb, model._arena, model._step
    if not step.decode:
        kernels(0, n, hb.slots, False)
    elif not step.sequential:
        kernels(0, n, hb.slots, True)
    else:
        for r, (slot, before, after) in enumerate(step.sequential):
            if before >= 0:
                arena.copy_layer(li, slot, before, stream)
            kernels(r, 1, hb.slots.offset(4 * r), True)
            if after >= 0:
                arena.copy_layer(li, slot, after, stream)


def gdn_layer(model, stream: int, L, n: int) -> None:
    """ws.hidden[n, hidden] = the gated DeltaNet of ws.normed[n, hidden] (layer weights L)."""
    b, ws, hb, m = model.backend, model._ws, model._hb, model._meta
    g, arena, step = m.hybrid.gdn, model._arena, model._step
    C, V, PW, hid = g.conv_dim, g.value_dim, hb.proj_width, m.hidden_size
    K, Hv = g.key_dim, g.num_v_heads
    li = L.state_index
    run_linear(b, stream, hb.proj, ws.normed, L.in_proj, n, PW, hid)
    run_linear(b, stream, hb.ab, ws.normed, L.in_proj_ab, n, 2 * Hv, hid)
    state, conv = arena.state_base(li), arena.conv_base(li)

    def kernels(row: int, rows: int, slots_ptr, decode: bool) -> None:
        conv_out, x = hb.conv.offset(2 * row * C), hb.proj.offset(2 * row * PW)
        q, core = conv_out, hb.core.offset(2 * row * V)
        b_ptr = hb.ab.offset(2 * row * 2 * Hv)
        a_ptr = b_ptr.offset(2 * Hv)
        if decode:
            causal_conv1d.causal_conv1d_update(b, stream, conv_out, C, x, PW, L.conv_w, 0,
                                               conv, arena.conv_stride, slots_ptr, rows, C,
                                               g.conv_kernel)
            gated_delta_rule.gdr_decode(b, stream, core, q, q.offset(2 * K), q.offset(4 * K),
                                        C, a_ptr, b_ptr, 2 * Hv, L.a_log, L.dt_bias, state,
                                        arena.state_stride, slots_ptr, rows, g.num_k_heads,
                                        Hv, g.k_head_dim, g.v_head_dim)
            return
        causal_conv1d.causal_conv1d_prefill(b, stream, conv_out, C, x, PW, L.conv_w, 0, conv,
                                            arena.conv_stride, slots_ptr, ws.qo_indptr,
                                            hb.start_pos, step.n_seqs, step.max_len, C,
                                            g.conv_kernel)
        gated_delta_rule.gdr_prefill(b, stream, core, q, q.offset(2 * K), q.offset(4 * K), C,
                                     a_ptr, b_ptr, 2 * Hv, L.a_log, L.dt_bias, state,
                                     arena.state_stride, slots_ptr, ws.qo_indptr, hb.start_pos,
                                     step.n_seqs, g.num_k_heads, Hv, g.k_head_dim,
                                     g.v_head_dim)

    run_recurrent(model, stream, li, n, kernels)
    gated_norm.rmsnorm_gated(b, stream, hb.core, hb.core, hb.proj.offset(2 * C), L.gated_norm,
                             n, V, g.v_head_dim, g.v_head_dim, PW, m.rms_norm_eps, True)
    run_linear(b, stream, ws.hidden, hb.core, L.out_proj, n, hid, V)
