"""DeepSeek-V3's MTP module in float64 numpy, written from the DeepSeek-V3 report (section
2.2, the MTP module) and transformers' DeepseekV3 layer definitions (its decoder block), for
tests/model/test_deepseek_mtp.py. transformers drops the MTP weights, so this is the
module's reference:

    x_k = eh_proj @ [enorm * rms(embed(t_{k+1})) ; hnorm * rms(h_k)]
    y_k = the decoder block on x (causal over keys 0..k, rope position k + 1)
    logits_k = shared_head.head @ (shared_head.norm * rms(y_k))
The block is computed in its decompressed form (keys and values expanded from the latent
per head), not the absorbed form the kernels run.
"""
from __future__ import annotations

import json
import math

import numpy as np


def _f64(src, name):
    u = np.asarray(src.read_bf16(name)).astype(np.uint32) << 16
    return u.view(np.float32).astype(np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _yarn(cfg, positions):
    """cos, sin [n, rope_dim / 2] of transformers' yarn (the fixture's rope)."""
    rp, d = cfg["rope_parameters"], cfg["qk_rope_head_dim"]
    base, factor = rp["rope_theta"], rp["factor"]
    orig = rp["original_max_position_embeddings"]
    pos_freqs = base ** (np.arange(0, d, 2) / d)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def corr(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo = max(math.floor(corr(rp["beta_fast"])), 0)
    hi = min(math.ceil(corr(rp["beta_slow"])), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp
    inv = inter * (1 - keep) + extra * keep

    def mscale(m):
        return 0.1 * m * math.log(factor) + 1 if factor > 1 else 1.0
    att = mscale(rp["mscale"]) / mscale(rp["mscale_all_dim"])
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    return np.cos(ang) * att, np.sin(ang) * att


def _rope(x, cos, sin):
    """Rotate the adjacent pairs (2i, 2i + 1) of x [n, ..., d] (rope_interleave)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c = cos.reshape(cos.shape[:1] + (1,) * (x.ndim - 2) + cos.shape[1:])
    s = sin.reshape(c.shape)
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


class MtpReference:
    def __init__(self, source, config_path):
        self.cfg = cfg = json.loads(open(config_path).read())
        self.p = p = f"model.layers.{cfg['num_hidden_layers']}."
        names = [n for n in source.tensor_names() if n.startswith(p)]
        self.w = {n[len(p):]: _f64(source, n) for n in names}
        self.eps = cfg["rms_norm_eps"]

    def hidden_in(self, tokens, hidden):
        """x [n, hidden] of the pairs (hidden rows h_k, tokens t_{k+1})."""
        w, e = self.w, self.eps
        emb = _rms(w["embed_tokens.weight"][np.asarray(tokens)], w["enorm.weight"], e)
        h = _rms(np.asarray(hidden, np.float64), w["hnorm.weight"], e)
        return np.concatenate([emb, h], -1) @ w["eh_proj.weight"].T

    def block(self, x, keys):
        """y [n, hidden] of the block over rows x at pair keys `keys` (0..n-1 in order)."""
        c, w, e = self.cfg, self.w, self.eps
        H, dn, dr, dv = (c["num_attention_heads"], c["qk_nope_head_dim"],
                         c["qk_rope_head_dim"], c["v_head_dim"])
        R, n = c["kv_lora_rank"], len(x)
        a = _rms(x, w["input_layernorm.weight"], e)
        qa = _rms(a @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], e)
        q = (qa @ w["self_attn.q_b_proj.weight"].T).reshape(n, H, dn + dr)
        kv = a @ w["self_attn.kv_a_proj_with_mqa.weight"].T
        lat = _rms(kv[:, :R], w["self_attn.kv_a_layernorm.weight"], e)
        cos, sin = _yarn(c, np.asarray(keys) + 1)
        q_rope = _rope(q[..., dn:], cos, sin)
        k_rope = _rope(kv[:, R:], cos, sin)
        kvb = (lat @ w["self_attn.kv_b_proj.weight"].T).reshape(n, H, dn + dv)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]
        rp = c["rope_parameters"]
        ms = 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1
        scale = (dn + dr) ** -0.5 * ms * ms
        s = (np.einsum("qhd,khd->hqk", q[..., :dn], k_nope) +
             np.einsum("qhd,kd->hqk", q_rope, k_rope)) * scale
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(n, H * dv)
        x2 = x + o @ w["self_attn.o_proj.weight"].T
        return x2 + self._moe(_rms(x2, w["post_attention_layernorm.weight"], e))

    def _moe(self, b):
        c, w = self.cfg, self.w
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        G, TG = c["n_group"], c["topk_group"]
        s = 1 / (1 + np.exp(-(b @ w["mlp.gate.weight"].T)))
        choice = s + w["mlp.gate.e_score_correction_bias"]
        out = np.zeros_like(b)

        def mlp(x, pre):
            g, u = x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T
            return (g / (1 + np.exp(-g)) * u) @ w[pre + "down_proj.weight"].T
        for r in range(len(b)):
            grp = np.sort(choice[r].reshape(G, E // G), -1)[:, -2:].sum(-1)
            keep = np.argsort(-grp, kind="stable")[:TG]
            masked = np.full(E, -np.inf)
            for g in keep:
                masked[g * (E // G):(g + 1) * (E // G)] = choice[r, g * (E // G):(g + 1) * (E // G)]
            top = np.argsort(-masked, kind="stable")[:k]
            wt = s[r, top] / (s[r, top].sum() + 1e-20) * c["routed_scaling_factor"]
            for ex, we in zip(top, wt):
                out[r] += we * mlp(b[r:r + 1], f"mlp.experts.{ex}.")[0]
        return out + mlp(b, "mlp.shared_experts.")

    def logits(self, y):
        w = self.w
        return _rms(y, w["shared_head.norm.weight"], self.eps) @ w["shared_head.head.weight"].T

    def propose(self, tokens, hidden, token, num_drafts, fed=None):
        """The chain: `tokens` t_0..t_{p-1}, `hidden` h_0..h_{p-1} [p, hidden], `token` t_p;
        returns (logits [num_drafts, vocab], its drafts). `fed`: the drafts the chain feeds
        on (default its own), so a near-tie elsewhere cannot fork the comparison."""
        toks = list(tokens[1:]) + [token]
        xs = self.hidden_in(toks, hidden)
        rows, drafts = [], []
        for j in range(num_drafts):
            y = self.block(xs, np.arange(len(xs)))
            rows.append(self.logits(y[-1:])[0])
            drafts.append(int(np.argmax(rows[-1])))
            nxt = drafts[-1] if fed is None else fed[j]
            xs = np.concatenate([xs, self.hidden_in([nxt], y[-1:])])
        return np.stack(rows), drafts
