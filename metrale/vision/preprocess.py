"""Image preprocessing for CLIP towers, on the host with numpy: what `CLIPImageProcessor`
does with its PIL backend.

  1. resize so the shortest side is `shortest_edge` (the other side `int(edge * long /
     short)`), bicubic, on uint8 pixels — Pillow's `Image.resize` arithmetic reproduced
     exactly: two separable passes (in Pillow's order) with antialiasing (the filter
     widens by the downscale factor), coefficients in 22-bit fixed point and a uint8
     rounding between the passes;
  2. center crop to `crop_size` (zero padding where the image is smaller, like HF's
     `center_crop`);
  3. rescale by `rescale_factor` (1/255) and normalize with `image_mean` / `image_std`
     (the checkpoint's preprocessor_config.json, else the CLIP defaults);
  4. HWC -> `[1, 3, H, W]` float32.

`load_image(path)` reads PNG/JPEG/... through Pillow (the optional extra `vision`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, InvalidArgument, Unsupported

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"

# Pillow's resample ids (PIL.Image.Resampling)
NEAREST, BILINEAR, BICUBIC = 0, 2, 3
_PRECISION_BITS = 32 - 8 - 2


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a CLIP `preprocessor_config.json` that preprocessing uses."""

    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    rescale_factor: float = 1.0 / 255.0
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    resample: int = BICUBIC

    def __post_init__(self) -> None:
        for name in ("shortest_edge", "crop_height", "crop_width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"ImageProcessorConfig.{name} must be a positive int, "
                                      f"got {v!r}")
        if self.resample not in (BILINEAR, BICUBIC):
            raise Unsupported(f"ImageProcessorConfig.resample {self.resample!r}: only bicubic "
                              f"({BICUBIC}) and bilinear ({BILINEAR}) are implemented")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if len(v) != 3:
                raise InvalidArgument(f"ImageProcessorConfig.{name} must hold 3 values, got "
                                      f"{v!r}")
        if any(float(s) == 0.0 for s in self.image_std):
            raise InvalidArgument(f"ImageProcessorConfig.image_std has a zero: {self.image_std}")

    @staticmethod
    def clip_defaults(image_size: int = 224) -> "ImageProcessorConfig":
        """CLIP's defaults at a tower's input size (resize + crop to `image_size`)."""
        return ImageProcessorConfig(shortest_edge=image_size, crop_height=image_size,
                                    crop_width=image_size)

    @staticmethod
    def from_dict(d: dict, image_size: int | None = None,
                  where: str = PREPROCESSOR_CONFIG) -> "ImageProcessorConfig":
        """From a preprocessor_config.json object (both the `{"shortest_edge": n}` and the
        older plain-int forms of `size` / `crop_size`)."""
        if not isinstance(d, dict):
            raise FormatError(f"{where}: must hold a JSON object")
        base = ImageProcessorConfig.clip_defaults(image_size or 224)
        size = d.get("size", base.shortest_edge)
        if isinstance(size, dict):
            if "shortest_edge" in size:
                size = size["shortest_edge"]
            elif "height" in size and "width" in size and size["height"] == size["width"]:
                size = size["height"]
            else:
                raise Unsupported(f"{where}: size {size!r} is not supported (expected "
                                  "shortest_edge)")
        crop = d.get("crop_size", {"height": base.crop_height, "width": base.crop_width})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(crop, dict) or "height" not in crop or "width" not in crop:
            raise FormatError(f"{where}: crop_size {crop!r} must be an int or "
                              "{height, width}")
        try:
            return ImageProcessorConfig(
                shortest_edge=int(size), crop_height=int(crop["height"]),
                crop_width=int(crop["width"]),
                do_resize=bool(d.get("do_resize", True)),
                do_center_crop=bool(d.get("do_center_crop", True)),
                do_rescale=bool(d.get("do_rescale", True)),
                do_normalize=bool(d.get("do_normalize", True)),
                rescale_factor=float(d.get("rescale_factor", 1.0 / 255.0)),
                image_mean=tuple(float(x) for x in _three(d.get("image_mean", CLIP_MEAN))),
                image_std=tuple(float(x) for x in _three(d.get("image_std", CLIP_STD))),
                resample=int(d.get("resample", BICUBIC)))
        except (TypeError, ValueError) as e:
            raise FormatError(f"{where}: {e}") from None

    @staticmethod
    def from_pretrained(path, image_size: int | None = None) -> "ImageProcessorConfig":
        """The checkpoint directory's preprocessor_config.json, else CLIP defaults at the
        vision tower's `image_size` (read from config.json when not given)."""
        p = Path(path)
        if p.is_file():
            p = p.parent
        if image_size is None and (p / "config.json").is_file():
            try:
                cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
                image_size = int((cfg.get("vision_config") or {}).get("image_size", 224))
            except (OSError, ValueError, TypeError, AttributeError):
                image_size = None
        f = p / PREPROCESSOR_CONFIG
        if f.is_file():
            try:
                d = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise FormatError(f"{f}: not valid JSON ({e})") from None
            return ImageProcessorConfig.from_dict(d, image_size, where=str(f))
        return ImageProcessorConfig.clip_defaults(image_size or 224)


def _three(v):
    if isinstance(v, (int, float)):
        return (v, v, v)
    return v


def image_processor_config(config) -> ImageProcessorConfig:
    """Turn what `preprocess_image` accepts as `config` into an `ImageProcessorConfig`."""
    if isinstance(config, ImageProcessorConfig):
        return config
    if isinstance(config, dict):
        return ImageProcessorConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return ImageProcessorConfig.from_pretrained(config)
    getter = getattr(config, "image_processor_config", None)
    if callable(getter):  # LlavaModel, LlavaGenerativeModel
        return getter()
    vision = getattr(config, "vision", None)  # ModelMetadata of a llava checkpoint
    if vision is not None:
        config = vision
    size = getattr(config, "image_size", None)
    if isinstance(size, int):  # VisionConfig
        return ImageProcessorConfig.clip_defaults(size)
    raise InvalidArgument(f"preprocess_image: config must be an ImageProcessorConfig, a "
                          f"preprocessor_config dict, a checkpoint path, a llava model or its "
                          f"metadata, got {type(config).__name__}")


# -------------------------------------------------------------------------------- resize
def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                    np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


_FILTERS = {BICUBIC: (_bicubic, 2.0), BILINEAR: (_bilinear, 1.0)}


def _coeffs(in_size: int, out_size: int, resample: int):
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc: (xmin [out], fixed-point int64
    coefficients [out, ksize]); taps past an output's support are 0."""
    filt, fsupport = _FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = fsupport * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = 1.0 / filterscale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    k = np.zeros((out_size, ksize), np.float64)
    ww = np.zeros(out_size, np.float64)
    for x in range(ksize):  # sequential sum, as Pillow accumulates ww
        valid = x < xmax
        w = filt(((x + xmin).astype(np.float64) - center + 0.5) * ss)
        k[:, x] = np.where(valid, w, 0.0)
        ww = np.where(valid, ww + w, ww)
    k = np.where(ww[:, None] != 0.0, k / np.where(ww == 0.0, 1.0, ww)[:, None], k)
    one = float(1 << _PRECISION_BITS)
    fixed = np.where(k < 0, np.trunc(-0.5 + k * one), np.trunc(0.5 + k * one)).astype(np.int64)
    return xmin, fixed


def _resample_axis(img: np.ndarray, out_size: int, axis: int, resample: int) -> np.ndarray:
    """One separable pass over uint8 `img` [H, W, C] along `axis` (0 or 1)."""
    in_size = img.shape[axis]
    xmin, k = _coeffs(in_size, out_size, resample)
    src = np.moveaxis(img, axis, 0).astype(np.int64)          # [in, other, C]
    acc = np.full((out_size,) + src.shape[1:], 1 << (_PRECISION_BITS - 1), np.int64)
    for j in range(k.shape[1]):
        idx = np.minimum(xmin + j, in_size - 1)                # k is 0 past the support
        acc += src[idx] * k[:, j][:, None, None]
    out = np.where(acc <= 0, 0, np.where(acc >= (1 << _PRECISION_BITS << 8), 255,
                                         acc >> _PRECISION_BITS)).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def resize(image: np.ndarray, height: int, width: int, resample: int = BICUBIC) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [height, width, C], as Pillow's `Image.resize((width,
    height), resample)` (bicubic or bilinear, antialiased, two separable passes)."""
    img = _as_hwc_uint8(image, "resize")
    if resample not in _FILTERS:
        raise Unsupported(f"resize: resample {resample!r} is not implemented (bicubic "
                          f"{BICUBIC}, bilinear {BILINEAR})")
    for name, v in (("height", height), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise InvalidArgument(f"resize: {name} must be a positive int, got {v!r}")
    h, w = img.shape[:2]
    # Pillow (>= 10.x) runs the vertical pass first when the height shrinks more than twice
    # as much as the width, else the horizontal one; the uint8 rounding between the passes
    # makes the order visible in the result.
    dy, dx = h - int(height), w - int(width)
    if dy > 0 and dy > dx * 2:
        img = _resample_axis(img, int(height), 0, resample)
        img = _resample_axis(img, int(width), 1, resample)
    else:
        if w != width:
            img = _resample_axis(img, int(width), 1, resample)
        if h != height:
            img = _resample_axis(img, int(height), 0, resample)
    return img.copy() if img is image else img


def resize_shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(new_height, new_width) with the shortest side `edge` (HF's
    get_resize_output_image_size with default_to_square=False)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(image: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """HF's `center_crop` on [H, W, C]: top = (H - h) // 2, left = (W - w) // 2; an image
    smaller than the crop is zero-padded (centered, the extra pixel at the top/left)."""
    h, w = image.shape[:2]
    top, left = (h - crop_height) // 2, (w - crop_width) // 2
    if top >= 0 and left >= 0:
        return image[top:top + crop_height, left:left + crop_width]
    nh, nw = max(crop_height, h), max(crop_width, w)
    padded = np.zeros((nh, nw) + image.shape[2:], image.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded[tp:tp + h, lp:lp + w] = image
    top, left = top + tp, left + lp
    return padded[top:top + crop_height, left:left + crop_width]


def _as_hwc_uint8(image, what: str) -> np.ndarray:
    img = np.asarray(image)
    if img.dtype != np.uint8:
        raise InvalidArgument(f"{what}: image must be a uint8 array, got {img.dtype}")
    if img.ndim == 2:
        img = img[:, :, None]
    if img.ndim != 3 or img.shape[0] < 1 or img.shape[1] < 1 or img.shape[2] < 1:
        raise InvalidArgument(f"{what}: image must be [H, W, 3] uint8, got shape {img.shape}")
    return img


def _to_rgb(img: np.ndarray) -> np.ndarray:
    c = img.shape[2]
    if c == 3:
        return img
    if c == 1:  # L -> RGB
        return np.repeat(img, 3, axis=2)
    if c == 4:  # RGBA -> RGB drops alpha, as PIL's convert("RGB")
        return img[:, :, :3]
    raise InvalidArgument(f"preprocess_image: image has {c} channels; expected 3 (RGB), "
                          "1 (grayscale) or 4 (RGBA)")


def preprocess_image(image, config=None) -> np.ndarray:
    """uint8 `[H, W, 3]` pixels -> float32 `[1, 3, crop_h, crop_w]` for the vision tower.

    `config`: an `ImageProcessorConfig`, a preprocessor_config.json dict, a checkpoint
    directory, a llava model (pointer or tensor API) or its metadata; None: CLIP defaults
    (224). Grayscale `[H, W]` / `[H, W, 1]` and RGBA `[H, W, 4]` are converted to RGB.
    """
    cfg = ImageProcessorConfig() if config is None else image_processor_config(config)
    img = _to_rgb(_as_hwc_uint8(image, "preprocess_image"))
    if cfg.do_resize:
        nh, nw = resize_shortest_edge_size(img.shape[0], img.shape[1], cfg.shortest_edge)
        img = resize(img, nh, nw, cfg.resample)
    if cfg.do_center_crop:
        img = center_crop(img, cfg.crop_height, cfg.crop_width)
    x = img.astype(np.float64)
    if cfg.do_rescale:
        x = x * cfg.rescale_factor
    x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, np.float32)
        std = np.asarray(cfg.image_std, np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)


def load_image(path) -> np.ndarray:
    """Read an image file (PNG, JPEG, ... anything Pillow opens) as uint8 `[H, W, 3]` RGB.

    Needs Pillow: `pip install 'metrale[vision]'`.
    """
    try:
        from PIL import Image
    except ImportError:
        raise Unsupported("load_image needs Pillow, which is not installed; install the "
                          "optional extra: pip install 'metrale[vision]' (or pip install "
                          "pillow)") from None
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"load_image: {p}: no such file")
    try:
        with Image.open(p) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise FormatError(f"{p}: cannot read the image ({e})") from None
