"""An independent float64 numpy reference of the LLaVA image path (CLIP tower + projector),
written from the Hugging Face modules' definitions (CLIPVisionEmbeddings, CLIPEncoderLayer,
LlavaMultiModalProjector), reading the checkpoint's BF16 weights."""
from __future__ import annotations

import math

import numpy as np

from metrale.ops.bf16 import bf16_to_f32

P = "vision_tower.vision_model."
_ACTS = {
    "quick_gelu": lambda x: x / (1.0 + np.exp(-1.702 * x)),
    "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
    "gelu_pytorch_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                             * (x + 0.044715 * x ** 3))),
}


def _w(source, name):
    return bf16_to_f32(source.read_bf16(name)).astype(np.float64)


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def image_features(source, pixel_values: np.ndarray) -> np.ndarray:
    """[1, C, H, W] -> [F, text_hidden] float64 (LlavaModel.get_image_features)."""
    meta = source.metadata()
    v = meta.vision
    d, p, H = v.hidden_size, v.patch_size, v.num_heads
    px = np.asarray(pixel_values, np.float64)[0]
    c, h, w = px.shape
    g = h // p
    patches = px[:, :g * p, :g * p].reshape(c, g, p, g, p).transpose(1, 3, 0, 2, 4)
    patches = patches.reshape(g * g, c * p * p)
    conv = _w(source, P + "embeddings.patch_embedding.weight").reshape(d, -1)
    x = np.concatenate([_w(source, P + "embeddings.class_embedding")[None], patches @ conv.T])
    x = x + _w(source, P + "embeddings.position_embedding.weight")
    x = _ln(x, _w(source, P + "pre_layrnorm.weight"), _w(source, P + "pre_layrnorm.bias"),
            v.layer_norm_eps)
    hidden = [x]
    act = _ACTS[v.hidden_act]
    hd = d // H
    for i in range(v.num_layers):
        q = f"{P}encoder.layers.{i}."
        lin = lambda name, t: t @ _w(source, q + name + ".weight").T + _w(source, q + name + ".bias")  # noqa: E731
        y = _ln(x, _w(source, q + "layer_norm1.weight"), _w(source, q + "layer_norm1.bias"),
                v.layer_norm_eps)
        qq = lin("self_attn.q_proj", y).reshape(-1, H, hd).transpose(1, 0, 2) * hd ** -0.5
        kk = lin("self_attn.k_proj", y).reshape(-1, H, hd).transpose(1, 0, 2)
        vv = lin("self_attn.v_proj", y).reshape(-1, H, hd).transpose(1, 0, 2)
        s = qq @ kk.transpose(0, 2, 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ vv).transpose(1, 0, 2).reshape(-1, d)
        x = x + lin("self_attn.out_proj", o)
        y = _ln(x, _w(source, q + "layer_norm2.weight"), _w(source, q + "layer_norm2.bias"),
                v.layer_norm_eps)
        x = x + lin("mlp.fc2", act(lin("mlp.fc1", y)))
        hidden.append(x)
    feats = hidden[v.vision_feature_layer]
    if v.vision_feature_select_strategy == "default":
        feats = feats[1:]
    y = feats @ _w(source, "multi_modal_projector.linear_1.weight").T
    if v.projector_bias:
        y = y + _w(source, "multi_modal_projector.linear_1.bias")
    y = _ACTS[v.projector_hidden_act](y)
    y = y @ _w(source, "multi_modal_projector.linear_2.weight").T
    if v.projector_bias:
        y = y + _w(source, "multi_modal_projector.linear_2.bias")
    return y
