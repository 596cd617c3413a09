"""Reading logits through any pointer (issue 18 items 2, 3, 10; issue 14 item 4): argmax,
copies and the masked greedy pick accept any device pointer, bounds-checked against the
allocation that holds it; a foreign row is BF16; numpy destinations must match the row
format; `logits_to_numpy` and `device_array` read without traps."""
import ml_dtypes
import numpy as np
import pytest

import metrale
from metrale import InvalidArgument
from metrale.gpu_runtime import DevicePtr, HostBackend
from metrale.ops.argmax import argmax_rule
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.model.common import golden, load
from tests.ops.test_argmax import NO_ID, masked_reference

NAME = "llama_gqa"
IDS = golden(NAME)["input_ids"][0].tolist()


@pytest.fixture
def model():
    return load(NAME, HostBackend(), kv_blocks=64, block_size=4)


def foreign_rows(m, rows_f32):
    """BF16 rows in memory the model does not own (as a custom sampler's buffer)."""
    bits = f32_to_bf16(np.asarray(rows_f32, np.float32))
    p = m.backend.alloc(bits.nbytes + 6)   # a little slack past the rows
    m.backend.copy_h2d(bits, p)
    return p, bits


def test_argmax_and_copy_accept_a_foreign_pointer(model, rng):
    m, V = model, model.vocab_size()
    rows = rng.integers(-8, 9, size=(3, V)).astype(np.float32)
    rows[1, [5, 77]] = 50.0                        # a tie the device rule breaks its way
    p, bits = foreign_rows(m, rows)
    s = m.default_stream()
    assert not m.logits_ptr_is_fp32(p)
    want = [int(i) for i in argmax_rule(bf16_to_f32(bits))]
    assert m.argmax_batch(p, 3, s) == want
    assert m.argmax_on_device(DevicePtr(p).offset(V * 2), s) == want[1]
    out = np.empty((3, V), np.uint16)
    m.copy_logits_to_host(p, out)
    assert np.array_equal(out, bits)
    with pytest.raises(InvalidArgument, match="run past the end"):
        m.argmax_batch(p, 4, s)
    with pytest.raises(InvalidArgument, match="not inside any live device allocation"):
        m.argmax_on_device(DevicePtr(np.zeros(4).ctypes.data), s)
    m.backend.free(p)
    with pytest.raises(InvalidArgument):            # freed memory is no longer readable
        m.argmax_on_device(p, s)


def test_copy_into_bytes_copies_exactly_len_dst(model):
    m, s = model, model.default_stream()
    seq = m.alloc_sequence()
    p = m.prefill(IDS[:5], seq, s)
    row = np.empty(m.vocab_size(), np.uint16)
    m.copy_logits_to_host(p, row)
    dst = bytearray(b"\xAA" * 10)
    m.copy_logits_to_host(p, dst)                 # 10 bytes, not a whole row, as in Rust
    assert bytes(dst) == row.view(np.uint8)[:10].tobytes()
    odd = bytearray(7)
    m.copy_logits_to_host(DevicePtr(p).offset(3), odd)
    assert bytes(odd) == row.view(np.uint8)[3:10].tobytes()
    m.copy_logits_to_host(p, bytearray(0))        # nothing to copy is not an error


def test_numpy_destination_dtype_must_match_the_row_format(model):
    m, s = model, model.default_stream()
    seq = m.alloc_sequence()
    m.prefill(IDS[:5], seq, s)
    p = m.decode(IDS[5], seq, s)
    V = m.vocab_size()
    with pytest.raises(InvalidArgument, match="float32.*BF16"):
        m.copy_logits_to_host(p, np.empty(V, np.float32))
    with pytest.raises(InvalidArgument, match="int32"):
        m.copy_logits_to_host(p, np.empty(V, np.int32))
    bits = np.empty(V, np.uint16)
    m.copy_logits_to_host(p, bits)
    bf = np.empty(V, ml_dtypes.bfloat16)
    m.copy_logits_to_host(p, bf)
    assert np.array_equal(bf.view(np.uint16), bits)
    f32 = load(NAME, HostBackend(), kv_blocks=64, block_size=4, fp32_logits=True)
    q = f32.alloc_sequence()
    fp = f32.prefill(IDS[:5], q, s)
    with pytest.raises(InvalidArgument, match="uint16.*FP32"):
        f32.copy_logits_to_host(fp, np.empty(V, np.uint16))
    f32.copy_logits_to_host(fp, np.empty(V, np.float32))


def test_logits_to_numpy_after_prefill_and_decode_batch(model):
    m, s = model, model.default_stream()
    seqs = [m.alloc_sequence() for _ in range(3)]
    p = m.prefill(IDS[:7], seqs[0], s)
    one = m.logits_to_numpy(p)
    bits = np.empty(m.vocab_size(), np.uint16)
    m.copy_logits_to_host(p, bits)
    assert one.dtype == np.float32 and one.shape == (1, m.vocab_size())
    assert np.array_equal(one[0], bf16_to_f32(bits))
    for q in seqs[1:]:
        m.prefill(IDS[:4], q, s)
    rows = m.logits_to_numpy(m.decode_batch([1, 2, 3], seqs, s), n=3)
    assert rows.shape == (3, m.vocab_size()) and np.isfinite(rows).all()
    assert m.argmax_batch(m.logits_buffer_ptr(), 3, s) == [int(i) for i in argmax_rule(rows)]


def test_only_the_models_own_fp32_buffer_is_fp32():
    m = load(NAME, HostBackend(), kv_blocks=64, block_size=4, fp32_logits=True)
    s = m.default_stream()
    seq = m.alloc_sequence()
    own = m.prefill(IDS[:5], seq, s)
    assert m.logits_ptr_is_fp32(own) and own == m.decode_logits_ptr()
    rows = np.zeros((1, m.vocab_size()), np.float32)
    rows[0, 9] = 3.0
    p, _ = foreign_rows(m, rows)
    assert not m.logits_ptr_is_fp32(p) and m.argmax_on_device(p, s) == 9   # read as BF16
    want = int(argmax_rule(m.logits_to_numpy(own))[0])
    assert m.argmax_on_device(own, s) == want


def test_masked_argmax_on_the_models_rows_and_a_foreign_buffer(model, rng):
    m, s, V = model, model.default_stream(), model.vocab_size()
    seqs = [m.alloc_sequence() for _ in range(2)]
    for q in seqs:
        m.prefill(IDS[:5], q, s)
    rows_ptr = m.decode_batch([7, 8], seqs, s)
    rows = m.logits_to_numpy(rows_ptr, 2)
    top = int(np.argmax(rows[0]))
    masks = [[top, top, V + 3], []]
    got = m.argmax_batch_masked(rows_ptr, 2, masks, s)
    assert got == [masked_reference(r, mk) for r, mk in zip(rows, masks)] and got[0] != top
    crafted = np.zeros((3, V), np.float32)
    crafted[0, [4, V - 2]] = 6.0                   # a tie: the highest index wins
    crafted[1, 3] = 9.0                            # suppressed max
    p, _ = foreign_rows(m, crafted)
    assert m.argmax_batch_masked(p, 3, [[], [3], [0]], s) == [V - 2, V - 1, V - 1]


def test_masked_argmax_returns_none_where_the_device_path_cannot_decide(model):
    m, s, V = model, model.default_stream(), model.vocab_size()
    rows = np.zeros((2, V), np.float32)
    p, _ = foreign_rows(m, rows)
    assert m.argmax_batch_masked(p, 2, [[], []], s) == [V - 1, V - 1]
    assert m.argmax_batch_masked(p, 2, [list(range(9)), []], s) is None   # > 8 ids
    assert m.argmax_batch_masked(p, 2, [[]], s) is None                   # len(masks) != n
    assert m.argmax_batch_masked(p, 0, [], s) is None
    assert m.argmax_batch_masked(0, 2, [[], []], s) is None               # NULL
    assert m.argmax_batch_masked(p, 2, [list(range(V)), []], s) is None   # > 8 ids
    nan = rows.copy()
    nan[1, 17] = np.nan
    q, _ = foreign_rows(m, nan)
    assert m.argmax_batch_masked(q, 2, [[], []], s) is None
    assert m.argmax_batch_masked(q, 2, [[], [17]], s) == [V - 1, V - 1]  # NaN suppressed
    f32 = load(NAME, HostBackend(), kv_blocks=64, block_size=4, fp32_logits=True)
    seq = f32.alloc_sequence()
    assert f32.argmax_batch_masked(f32.prefill(IDS[:4], seq, s), 1, [[]], s) is None
    with pytest.raises(InvalidArgument):
        m.argmax_batch_masked(p, 2, [["x"], []], s)
    assert NO_ID > V


def test_device_array_is_a_zero_copy_view_with_dlpack(model):
    m, s, V = model, model.default_stream(), model.vocab_size()
    seq = m.alloc_sequence()
    p = m.prefill(IDS[:5], seq, s)
    row = metrale.device_array(p, (V,), np.uint16, m)
    shared = np.from_dlpack(row)
    assert np.shares_memory(shared, row)
    bits = np.empty(V, np.uint16)
    m.copy_logits_to_host(p, bits)
    assert np.array_equal(shared, bits)
    shared[3] = 0x4000                            # a write through the DLPack view ...
    m.copy_logits_to_host(p, bits)
    assert bits[3] == 0x4000                      # ... is the device memory itself
    hid = m._meta.hidden_size
    h = metrale.device_array(m.hidden_after_norm(), (1, hid), np.uint16, m.backend)
    assert h.shape == (1, hid) and np.shares_memory(np.from_dlpack(h), h)
    whole = m._ws.logits_rows * V * 2
    with pytest.raises(InvalidArgument, match="run past the end"):
        metrale.device_array(p, (whole // 2 + 1,), np.uint16, m)
    with pytest.raises(InvalidArgument, match="aligned"):
        metrale.device_array(DevicePtr(p).offset(1), (4,), np.uint16, m)
    with pytest.raises(InvalidArgument):
        metrale.device_array(p, (4,), np.uint16, object())


def test_device_array_takes_ml_dtypes_names_before_ml_dtypes_is_imported():
    """"bfloat16" (and the other ml_dtypes names) as a string, in a fresh process where
    nothing has imported ml_dtypes yet, as the API took it before the import became lazy."""
    code = """
import sys
import numpy as np
import metrale
m = metrale.load("preset:tiny", device="cpu", progress=False)
seq = m.alloc_sequence()
p = m.prefill([1, 2, 3], seq, 0)
assert "ml_dtypes" not in sys.modules
row = metrale.device_array(p, (m.vocab_size(),), "bfloat16", m)
bits = metrale.device_array(p, (m.vocab_size(),), "uint16", m)
assert str(row.dtype) == "bfloat16" and np.shares_memory(row, bits)
assert np.array_equal(row.view(np.uint16), bits)
try:
    metrale.device_array(p, (4,), "bfloat17", m)
except metrale.MetraleError as e:
    print("refused:", e)
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: device_array: bad shape (4,) or dtype 'bfloat17'" in out.stdout


@pytest.mark.gpu
def test_gpu_foreign_cupy_memory_and_dlpack(cuda, rng):
    import cupy as cp
    m = load(NAME, cuda, kv_blocks=64, block_size=4)
    s, V = m.default_stream(), m.vocab_size()
    rows = rng.integers(-8, 9, size=(2, V)).astype(np.float32)
    bits = f32_to_bf16(rows)
    foreign = cp.asarray(bits)                     # allocated by CuPy, not the backend
    base, size = cuda.find_allocation(foreign.data.ptr + 2)
    assert int(base) <= foreign.data.ptr and size >= bits.nbytes
    assert m.argmax_batch(foreign.data.ptr, 2, s) == [int(i) for i in argmax_rule(bf16_to_f32(bits))]
    assert m.argmax_batch_masked(foreign.data.ptr, 2, [[0], []], s) == \
        [masked_reference(r, mk) for r, mk in zip(bf16_to_f32(bits), [[0], []])]
    seq = m.alloc_sequence()
    p = m.prefill(IDS[:5], seq, s)
    arr = metrale.device_array(p, (V,), np.uint16, m)
    assert arr.__cuda_array_interface__["data"][0] == int(p)
    assert cp.from_dlpack(arr).data.ptr == int(p)
    try:
        import torch
    except ImportError:
        return
    t = torch.from_dlpack(arr)
    assert t.data_ptr() == int(p)
