"""WeightUploader onto HostBackend: bytes, live_bytes accounting, fused uploads, a 5 GB load."""
from __future__ import annotations

import json
import logging
import os
import struct
import time
import tracemalloc

import numpy as np
import pytest

from metrale import FormatError, InvalidArgument
from metrale.formats import (MemorySource, WeightUploader, check_tensors, expected_tensors,
                             open_source)
from metrale.gpu_runtime import HostBackend

from .test_source import FIXTURES


def _down(host, ptr, shape):
    out = np.empty(shape, np.uint16)
    host.copy_d2h(ptr, out)
    return out


def test_upload_every_tensor_of_a_fixture(host, caplog):
    src = open_source(FIXTURES / "qwen2")
    exp = expected_tensors(src.metadata())
    check_tensors(src, exp)
    total = sum(int(np.prod(s)) * 2 for s in exp.values())
    ptrs = {}
    with caplog.at_level(logging.DEBUG, logger="metrale"):
        with WeightUploader(host, src, total, desc="qwen2") as up:
            for name in exp:
                ptrs[name] = up.upload(name)
    assert up.bytes_uploaded == total == host.live_bytes()
    assert up.throughput_gbps() > 0
    assert any("GB/s" in r.getMessage() for r in caplog.records)
    for name, shape in exp.items():
        np.testing.assert_array_equal(_down(host, ptrs[name], shape), src.read_bf16(name))
    for p in ptrs.values():
        host.free(p)
    assert host.live_bytes() == 0


def test_upload_into_concatenates_along_dim0(host):
    src = MemorySource.preset("tiny")
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    rows = sum(src.tensor_shape(n)[0] for n in names)
    dst = host.alloc(rows * 128 * 2)
    with WeightUploader(host, src, rows * 128 * 2) as up:
        assert up.upload_into(names, dst) == rows * 128 * 2
    np.testing.assert_array_equal(_down(host, dst, (rows, 128)),
                                  np.concatenate([src.read_bf16(n) for n in names]))
    with WeightUploader(host, src, 0) as up, pytest.raises(FormatError, match="concatenate"):
        up.upload_into(["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"], dst)
    host.free(dst)
    assert host.live_bytes() == 0


def test_upload_array(host):
    src = MemorySource.preset("tiny")
    arr = np.arange(19, dtype=np.uint16)
    with WeightUploader(host, src, arr.nbytes) as up:
        p = up.upload_array(arr)
        assert host.live_bytes() == arr.nbytes
        up.upload_array(arr[::-1].copy(), p)
        with pytest.raises(InvalidArgument, match="uint16"):
            up.upload_array(arr.astype(np.float32))
    np.testing.assert_array_equal(_down(host, p, (19,)), arr[::-1])
    assert up.bytes_uploaded == 2 * arr.nbytes
    host.free(p)


def test_failed_copy_frees_its_buffer():
    host = HostBackend()
    src = MemorySource.preset("tiny")

    def boom(*a):
        raise RuntimeError("copy failed")
    host.copy_h2d = boom
    with WeightUploader(host, src, 1) as up, pytest.raises(RuntimeError):
        up.upload("model.norm.weight")
    assert host.live_bytes() == 0


def test_memory_limit_is_a_device_error():
    from metrale import DeviceError
    host = HostBackend(memory_limit_bytes=1000)
    src = MemorySource.preset("tiny")
    with WeightUploader(host, src, 1) as up, pytest.raises(DeviceError, match="out of memory"):
        up.upload("model.embed_tokens.weight")


# -- 5 GB: mmap straight into the backend, never a second full copy in host RAM -------------
def _write_big_checkpoint(path, layers: int) -> int:
    """A llama-shaped BF16 checkpoint (~0.44 GB per layer) written in 64 MiB chunks."""
    cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": layers, "num_attention_heads": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 4096, "rope_theta": 1e4,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    meta = MemorySource.from_config(cfg).metadata()
    header, off = {}, 0
    for name, shape in expected_tensors(meta).items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    chunk = np.random.default_rng(0).integers(0, 1 << 14, 32 << 20).astype(np.uint16).tobytes()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        left = off
        while left:
            k = min(left, len(chunk))
            f.write(chunk[:k])
            left -= k
        f.flush()
        os.fsync(f.fileno())
        # drop the file from the page cache so the load reads the disk (a cold load)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return off


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("METRALE_BIG_TEST") != "1",
                    reason="writes a 5 GB file; set METRALE_BIG_TEST=1")
def test_5gb_checkpoint_loads_through_mmap(tmp_path_factory):
    d = tmp_path_factory.mktemp("big") / "ck"
    total = _write_big_checkpoint(d, layers=11)
    assert total > 5e9
    try:
        src = open_source(d)
        exp = expected_tensors(src.metadata())
        check_tensors(src, exp)
        host = HostBackend()
        tracemalloc.start()
        t0 = time.perf_counter()
        with WeightUploader(host, src, total) as up:
            ptrs = [up.upload(n) for n in exp]
        secs = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"\n5 GB load: {total / 1e9:.2f} GB in {secs:.2f} s = {total / 1e9 / secs:.2f} GB/s "
              f"(cold page cache, HostBackend); peak traced host allocation "
              f"{peak / 1e9:.2f} GB")
        assert host.live_bytes() == total
        # the backend's buffers are the only full copy: no staging copy of the checkpoint
        assert peak < total * 1.05 + (64 << 20)
        last = list(exp)[-1]
        np.testing.assert_array_equal(_down(host, ptrs[-1], exp[last])[-1, -7:],
                                      src.read_bf16(last)[-1, -7:])
        for p in ptrs:
            host.free(p)
    finally:
        src.close()
        (d / "model.safetensors").unlink()
