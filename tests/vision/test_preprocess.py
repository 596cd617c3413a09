"""Image preprocessing: Pillow-compatible bicubic resize, center crop, CLIP normalization."""
import json
import math
import sys

import numpy as np
import pytest

from metrale.errors import FormatError, InvalidArgument, MetraleError, Unsupported
from metrale.vision import (CLIP_MEAN, CLIP_STD, ImageProcessorConfig, center_crop, load_image,
                            preprocess_image, resize)
from metrale.vision.preprocess import BICUBIC, BILINEAR, resize_shortest_edge_size


def cubic(x, a=-0.5):
    x = abs(x)
    if x < 1:
        return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
    if x < 2:
        return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a
    return 0.0


def resize_1d_float(line: np.ndarray, out: int) -> np.ndarray:
    """Independent antialiased Keys-cubic resampling of one line, in floats: output pixel i
    is centred at (i + 0.5) * in/out; taps at input pixel centres j + 0.5 within the filter
    support 2 * max(in/out, 1), weights cubic(dist / max(in/out, 1)) normalised to sum 1."""
    n = len(line)
    scale = n / out
    fs = max(scale, 1.0)
    res = np.empty((out,) + line.shape[1:])
    for i in range(out):
        c = (i + 0.5) * scale
        lo, hi = max(int(math.floor(c - 2 * fs)), 0), min(int(math.ceil(c + 2 * fs)), n)
        ws = np.array([cubic((j + 0.5 - c) / fs) for j in range(lo, hi)])
        res[i] = (ws[:, None] * line[lo:hi].reshape(hi - lo, -1)).sum(0).reshape(
            line.shape[1:]) / ws.sum()
    return res


def resize_float(img, h, w):
    x = img.astype(np.float64)
    x = np.stack([resize_1d_float(x[r], w) for r in range(x.shape[0])])
    x = np.clip(np.round(x), 0, 255)  # Pillow stores the intermediate as uint8
    x = np.stack([resize_1d_float(x[:, c], h) for c in range(x.shape[1])], axis=1)
    return np.clip(np.round(x), 0, 255)


@pytest.mark.parametrize("src,dst", [((20, 30), (10, 15)), ((17, 9), (40, 23)),
                                     ((32, 32), (32, 7)), ((13, 50), (13, 50)),
                                     ((64, 48), (21, 16))])
def test_resize_matches_independent_formula(rng, src, dst):
    img = rng.integers(0, 256, src + (3,), dtype=np.uint8)
    img = np.clip(np.cumsum(img.astype(int), 1) // np.arange(1, src[1] + 1)[None, :, None]
                  + img // 4, 0, 255).astype(np.uint8)  # some smooth structure
    got = resize(img, *dst)
    assert got.shape == dst + (3,) and got.dtype == np.uint8
    # Pillow's 22-bit fixed point and its pass order (vertical first when the height shrinks
    # much more) move a pixel by at most a few levels against the float formula.
    ref = resize_float(img, *dst)
    assert np.abs(got.astype(int) - ref).max() <= 3
    assert np.abs(got.astype(int) - ref).mean() < 0.6


def test_resize_identity_constant_and_bilinear(rng):
    img = rng.integers(0, 256, (11, 7, 3), dtype=np.uint8)
    assert np.array_equal(resize(img, 11, 7), img)
    const = np.full((40, 30, 3), 77, np.uint8)
    assert np.array_equal(resize(const, 13, 57), np.full((13, 57, 3), 77, np.uint8))
    # bilinear 2x downscale: the triangle widened to support 2 gives taps [1, 3, 3, 1] / 8,
    # so a ramp 8j maps to 16i + 4 away from the borders
    row = np.arange(0, 256, 8, dtype=np.uint8).reshape(1, -1, 1).repeat(3, 2)
    got = resize(row, 1, 16, BILINEAR)[0, :, 0].astype(int)
    assert np.array_equal(got[1:15], 16 * np.arange(1, 15) + 4)


def test_resize_matches_pillow_exactly(rng):
    Image = pytest.importorskip("PIL.Image")
    for _ in range(25):
        h, w, nh, nw = (int(v) for v in rng.integers(1, 120, 4))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for rs in (BICUBIC, BILINEAR):
            ref = np.asarray(Image.fromarray(img).resize((nw, nh), resample=rs))
            assert np.array_equal(resize(img, nh, nw, rs), ref), (h, w, nh, nw, rs)


def test_shortest_edge_and_center_crop():
    assert resize_shortest_edge_size(480, 640, 336) == (336, 448)
    assert resize_shortest_edge_size(640, 480, 336) == (448, 336)
    assert resize_shortest_edge_size(100, 100, 224) == (224, 224)
    img = np.arange(6 * 8 * 1).reshape(6, 8, 1)
    assert np.array_equal(center_crop(img, 4, 4), img[1:5, 2:6])
    assert np.array_equal(center_crop(img, 5, 3), img[0:5, 2:5])
    small = np.ones((2, 3, 1), np.uint8)
    pad = center_crop(small, 4, 4)  # HF pads with zeros, the extra row/col at the top/left
    assert pad.shape == (4, 4, 1) and pad.sum() == 6 and pad[1:3, 1:4].all()


def test_preprocess_pipeline_formula(rng):
    img = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    cfg = ImageProcessorConfig(shortest_edge=24, crop_height=24, crop_width=24)
    out = preprocess_image(img, cfg)
    assert out.shape == (1, 3, 24, 24) and out.dtype == np.float32
    r = resize(img, 24, 32)[:, 4:28]
    ref = ((r / 255.0).astype(np.float32) - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)
    np.testing.assert_allclose(out[0], ref.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)
    # grayscale and RGBA become RGB
    gray = rng.integers(0, 256, (30, 30), dtype=np.uint8)
    g = preprocess_image(gray, ImageProcessorConfig.clip_defaults(16))
    assert g.shape == (1, 3, 16, 16)
    np.testing.assert_allclose((g[0, 0] * CLIP_STD[0] + CLIP_MEAN[0]),
                               (g[0, 1] * CLIP_STD[1] + CLIP_MEAN[1]), atol=1e-5)
    rgba = np.concatenate([img, np.zeros((48, 64, 1), np.uint8)], axis=2)
    assert np.array_equal(preprocess_image(rgba, cfg), out)


def test_preprocess_config_sources(tmp_path):
    d = {"crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336},
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25], "resample": 3,
         "rescale_factor": 1 / 255, "do_center_crop": True}
    c = ImageProcessorConfig.from_dict(d)
    assert (c.shortest_edge, c.crop_height, c.image_mean) == (336, 336, (0.5, 0.5, 0.5))
    old = ImageProcessorConfig.from_dict({"size": 224, "crop_size": 224})
    assert (old.shortest_edge, old.crop_width, old.image_std) == (224, 224, CLIP_STD)
    assert ImageProcessorConfig.from_pretrained(tmp_path).crop_height == 224
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"image_size": 32}}))
    assert ImageProcessorConfig.from_pretrained(tmp_path).shortest_edge == 32
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(d))
    assert ImageProcessorConfig.from_pretrained(tmp_path).crop_height == 336
    img = np.zeros((10, 10, 3), np.uint8)
    assert preprocess_image(img, str(tmp_path)).shape == (1, 3, 336, 336)
    assert preprocess_image(img, d).shape == (1, 3, 336, 336)
    (tmp_path / "preprocessor_config.json").write_text("{nope")
    with pytest.raises(FormatError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_pretrained(tmp_path)
    with pytest.raises(Unsupported, match="resample"):
        ImageProcessorConfig(resample=1)


def test_preprocess_bad_input():
    with pytest.raises(InvalidArgument, match="uint8"):
        preprocess_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(InvalidArgument, match="shape"):
        preprocess_image(np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(InvalidArgument, match="channels"):
        preprocess_image(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(InvalidArgument, match="config"):
        preprocess_image(np.zeros((4, 4, 3), np.uint8), 3.5)
    with pytest.raises(InvalidArgument, match="height"):
        resize(np.zeros((4, 4, 3), np.uint8), 0, 4)


def test_load_image_without_pillow_is_a_metrale_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(Unsupported, match=r"metrale\[vision\]"):
        load_image(tmp_path / "x.png")


def test_load_image_roundtrip(tmp_path, rng):
    Image = pytest.importorskip("PIL.Image")
    img = rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "a.png")
    Image.fromarray(img[:, :, 0]).save(tmp_path / "g.png")
    assert np.array_equal(load_image(tmp_path / "a.png"), img)
    assert load_image(tmp_path / "g.png").shape == (9, 13, 3)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(MetraleError):
        load_image(tmp_path / "bad.png")
    with pytest.raises(InvalidArgument):
        load_image(tmp_path / "missing.png")
