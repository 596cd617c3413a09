"""The CLIP vision tower and the LLaVA projector over raw pointers.

One image at a time, T = num_patches + 1 token rows:
    patches  = patchify(pixels)                          [P, C*p*p]   (vision.cu)
    emb[1:]  = patches @ patch_embedding^T               [P, d]       (the stride-p conv)
    emb      = [class; emb[1:]] + position_embedding     [T, d]       (vision.cu)
    h        = pre_layrnorm(emb)                         hidden_states[0]
    per layer (pre-LayerNorm blocks):
        x = layer_norm1(h); qkv = x @ Wqkv^T + b; h += (attn(qkv) @ Wo^T + bo)
        x = layer_norm2(h); h += fc2(act(fc1(x)))        hidden_states[i + 1]
    feats    = hidden_states[vision_feature_layer]  ("default": rows 1..T-1, "full": all)
    out      = linear_2(gelu(linear_1(feats)))           [F, text_hidden]
Only the layers up to `vision_feature_layer` run (and are uploaded); `post_layernorm`
never touches LLaVA's features. Attention is dense and non-causal
(`ops.dense_attention`, q/k/v read in place from the fused qkv rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, InvalidArgument, Unsupported
from ..formats import check_tensors
from ..formats.layout import llava_tensors
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops import activation, elementwise, gemm_tc, rmsnorm
from ..ops import vision as vision_ops

PREFIX = "vision_tower.vision_model."
PROJECTOR = "multi_modal_projector."
# HF activation names -> ops.activation.gelu modes
GELU_MODES = {"quick_gelu": "quick", "gelu": "none", "gelu_new": "tanh",
              "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def gelu_mode(act: str, what: str) -> str:
    try:
        return GELU_MODES[act]
    except KeyError:
        raise Unsupported(f"{what} {act!r} is not supported (supported: "
                          f"{', '.join(sorted(GELU_MODES))})") from None


def feature_layer_count(vision) -> int:
    """Encoder layers to run so that hidden_states[vision_feature_layer] exists."""
    n = vision.num_layers
    idx = vision.vision_feature_layer
    idx = idx + n + 1 if idx < 0 else idx
    if not 0 <= idx <= n:
        raise FormatError(f"vision_feature_layer {vision.vision_feature_layer} is outside "
                          f"the {n + 1} hidden states of a {n}-layer vision tower")
    return idx


@dataclass
class ClipLayer:
    ln1_w: DevicePtr
    ln1_b: DevicePtr
    qkv: DevicePtr        # [3d, d]
    qkv_b: DevicePtr      # [3d]
    o: DevicePtr          # [d, d]
    o_b: DevicePtr
    ln2_w: DevicePtr
    ln2_b: DevicePtr
    fc1: DevicePtr        # [I, d]
    fc1_b: DevicePtr
    fc2: DevicePtr        # [d, I]
    fc2_b: DevicePtr


class ClipVisionTower(OwnedBuffers):
    """Weights and workspaces of the CLIP tower + projector of one llava checkpoint.

    `encode(images, out_ptr, stream)` writes `len(images) * num_features` rows of
    `text_hidden` BF16 features at `out_ptr`. `free()` returns every byte.
    """

    def __init__(self, backend, source, meta, progress: bool = True) -> None:
        v = meta.vision
        if v is None:
            raise FormatError(f"{source.description}: not a vision-language checkpoint")
        self.backend = backend
        self.vision = v
        self.description = source.description
        self.act = gelu_mode(v.hidden_act, f"{source.description}: vision hidden_act")
        self.proj_act = gelu_mode(v.projector_hidden_act,
                                  f"{source.description}: projector_hidden_act")
        d, inter, th = v.hidden_size, v.intermediate_size, v.text_hidden_size
        if d % v.num_heads:
            raise FormatError(f"{source.description}: vision hidden_size {d} is not a "
                              f"multiple of num_attention_heads {v.num_heads}")
        self.head_dim = d // v.num_heads
        if self.head_dim % 2 or self.head_dim > 256:
            raise Unsupported(f"{source.description}: vision head_dim {self.head_dim} must be "
                              "even and at most 256")
        if v.image_size % v.patch_size:
            raise Unsupported(f"{source.description}: vision image_size {v.image_size} is not "
                              f"a multiple of patch_size {v.patch_size}")
        self.n_layers = feature_layer_count(v)
        self.grid = v.image_size // v.patch_size
        self.n_patches = self.grid * self.grid
        self.n_tokens = self.n_patches + 1
        self.skip_cls = v.vision_feature_select_strategy == "default"
        self.n_features = self.n_patches if self.skip_cls else self.n_tokens
        self.patch_dim = v.num_channels * v.patch_size * v.patch_size
        self._owned: list[DevicePtr] = []
        # Check every vision/projector tensor (the text model's are checked by its loader).
        expected = {k: s for k, s in llava_tensors(meta).items()
                    if not k.startswith("language_model.")}
        check_tensors(source, expected, complete=False)   # llava.py checked the rest
        needed = [k for k in expected if self._needed(k)]
        self.weight_bytes = sum(2 * math.prod(expected[k]) for k in needed)
        T = self.n_tokens
        try:
            with WeightUploader(backend, source, self.weight_bytes,
                                desc=f"{source.description} (vision)", progress=progress) as up:
                u = lambda name: self._own(up.upload(name))  # noqa: E731
                self.patch_w = u(PREFIX + "embeddings.patch_embedding.weight")  # [d, C*p*p]
                self.class_emb = u(PREFIX + "embeddings.class_embedding")
                self.pos_emb = u(PREFIX + "embeddings.position_embedding.weight")
                self.pre_ln_w = u(PREFIX + "pre_layrnorm.weight")
                self.pre_ln_b = u(PREFIX + "pre_layrnorm.bias")
                self.layers: list[ClipLayer] = []
                for i in range(self.n_layers):
                    p = f"{PREFIX}encoder.layers.{i}."
                    att = p + "self_attn."
                    qkv = self._alloc(3 * d * d * 2)
                    up.upload_into([att + f"{x}_proj.weight" for x in "qkv"], qkv)
                    qkv_b = self._alloc(3 * d * 2)
                    up.upload_into([att + f"{x}_proj.bias" for x in "qkv"], qkv_b)
                    self.layers.append(ClipLayer(
                        ln1_w=u(p + "layer_norm1.weight"), ln1_b=u(p + "layer_norm1.bias"),
                        qkv=qkv, qkv_b=qkv_b,
                        o=u(att + "out_proj.weight"), o_b=u(att + "out_proj.bias"),
                        ln2_w=u(p + "layer_norm2.weight"), ln2_b=u(p + "layer_norm2.bias"),
                        fc1=u(p + "mlp.fc1.weight"), fc1_b=u(p + "mlp.fc1.bias"),
                        fc2=u(p + "mlp.fc2.weight"), fc2_b=u(p + "mlp.fc2.bias")))
                self.proj1 = u(PROJECTOR + "linear_1.weight")
                self.proj2 = u(PROJECTOR + "linear_2.weight")
                self.proj1_b = self.proj2_b = NULL
                if v.projector_bias:
                    self.proj1_b = u(PROJECTOR + "linear_1.bias")
                    self.proj2_b = u(PROJECTOR + "linear_2.bias")
            # workspaces (one image) ------------------------------------------------------
            a = self._alloc
            self.pixels = a(v.num_channels * v.image_size * v.image_size * 4)  # float32 CHW
            self.patches = a(self.n_patches * self.patch_dim * 2)
            self.h = a(T * d * 2)          # residual stream
            self.x = a(T * d * 2)          # norm outputs / sublayer outputs
            self.qkv = a(T * 3 * d * 2)
            self.attn = a(T * d * 2)
            self.mlp = a(T * max(inter, th) * 2)
        except BaseException:
            self.free()
            raise
        self.workspace_bytes = (v.num_channels * v.image_size ** 2 * 4
                                + self.n_patches * self.patch_dim * 2
                                + T * d * 2 * 4 + T * 3 * d * 2 + T * max(inter, th) * 2)

    def _needed(self, name: str) -> bool:
        if name.startswith(PREFIX + "post_layernorm"):
            return False
        if name.startswith(PREFIX + "encoder.layers."):
            return int(name[len(PREFIX + "encoder.layers."):].split(".")[0]) < self.n_layers
        return name.startswith(PREFIX) or name.startswith(PROJECTOR)

    # ------------------------------------------------------------------------------ checks
    @property
    def pixel_shape(self) -> tuple[int, int, int, int]:
        v = self.vision
        return (1, v.num_channels, v.image_size, v.image_size)

    def check_image(self, image, i: int) -> np.ndarray:
        """Image `i` as a C-contiguous float32 [C, H, W] host array, or InvalidArgument."""
        from ..gpu_runtime.arrays import to_numpy
        arr = np.asarray(to_numpy(image))
        if arr.shape != self.pixel_shape:
            raise InvalidArgument(f"image {i}: expected preprocessed pixels of shape "
                                  f"{list(self.pixel_shape)} (float32), got {list(arr.shape)}")
        if arr.dtype.kind != "f":
            raise InvalidArgument(f"image {i}: expected float pixels (preprocess_image "
                                  f"output), got dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr[0], dtype=np.float32)
        if not np.isfinite(arr).all():
            raise InvalidArgument(f"image {i}: pixels hold NaN or infinity")
        return arr

    # ------------------------------------------------------------------------------ forward
    def encode(self, images: list[np.ndarray], out_ptr: DevicePtr, stream: int) -> None:
        """Run the tower + projector over checked [C, H, W] float32 images; image i's
        features go to rows [i*F, (i+1)*F) of out ([*, text_hidden] bf16)."""
        th = self.vision.text_hidden_size
        self._host_pixels = list(images)  # kept alive until the next call (async h2d)
        for i, img in enumerate(images):
            self._encode_one(img, DevicePtr(out_ptr).offset(i * self.n_features * th * 2),
                             stream)

    def _encode_one(self, pixels: np.ndarray, out_ptr: DevicePtr, stream: int) -> None:
        b, v = self.backend, self.vision
        d, inter, th = v.hidden_size, v.intermediate_size, v.text_hidden_size
        T, P, eps = self.n_tokens, self.n_patches, v.layer_norm_eps
        H, D = v.num_heads, self.head_dim
        b.copy_h2d_async(pixels, self.pixels, stream)
        vision_ops.patchify(b, stream, self.patches, self.pixels, v.num_channels,
                            v.image_size, v.image_size, v.patch_size)
        gemm_tc.gemm_tc(b, stream, self.x.offset(d * 2), self.patches, self.patch_w, P, d,
                        self.patch_dim)
        vision_ops.class_pos_embed(b, stream, self.x, self.class_emb, self.pos_emb, T, d)
        rmsnorm.layernorm(b, stream, self.h, self.x, self.pre_ln_w, self.pre_ln_b, T, d, eps)
        from ..ops.dense_attention import dense_attention
        for L in self.layers:
            rmsnorm.layernorm(b, stream, self.x, self.h, L.ln1_w, L.ln1_b, T, d, eps)
            gemm_tc.gemm_tc(b, stream, self.qkv, self.x, L.qkv, T, 3 * d, d)
            elementwise.add_bias(b, stream, self.qkv, L.qkv_b, T, 3 * d)
            dense_attention(b, stream, self.attn, self.qkv, self.qkv.offset(d * 2),
                            self.qkv.offset(2 * d * 2), T, T, H, H, D, 3 * d, 3 * d,
                            D ** -0.5, False)
            gemm_tc.gemm_tc(b, stream, self.x, self.attn, L.o, T, d, d)
            elementwise.add_bias(b, stream, self.x, L.o_b, T, d)
            elementwise.add_inplace(b, stream, self.h, self.x, T * d)
            rmsnorm.layernorm(b, stream, self.x, self.h, L.ln2_w, L.ln2_b, T, d, eps)
            gemm_tc.gemm_tc(b, stream, self.mlp, self.x, L.fc1, T, inter, d)
            elementwise.add_bias(b, stream, self.mlp, L.fc1_b, T, inter)
            activation.gelu(b, stream, self.mlp, self.mlp, T * inter, self.act)
            gemm_tc.gemm_tc(b, stream, self.x, self.mlp, L.fc2, T, d, inter)
            elementwise.add_bias(b, stream, self.x, L.fc2_b, T, d)
            elementwise.add_inplace(b, stream, self.h, self.x, T * d)
        F = self.n_features
        feats = self.h.offset(d * 2) if self.skip_cls else self.h
        gemm_tc.gemm_tc(b, stream, self.mlp, feats, self.proj1, F, th, d)
        if not self.proj1_b.is_null():
            elementwise.add_bias(b, stream, self.mlp, self.proj1_b, F, th)
        activation.gelu(b, stream, self.mlp, self.mlp, F * th, self.proj_act)
        gemm_tc.gemm_tc(b, stream, out_ptr, self.mlp, self.proj2, F, th, th)
        if not self.proj2_b.is_null():
            elementwise.add_bias(b, stream, out_ptr, self.proj2_b, F, th)
