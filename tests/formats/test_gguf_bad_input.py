"""Malformed GGUF files (written with the `gguf` package's writer, tests/formats/gguf_util.py)
are refused with a FormatError naming the file and the key, before anything is sized by the
bad value: counts and sizes against the tensor directory, nesting depth, the tokenizer."""
from __future__ import annotations

import pytest

from metrale.errors import FormatError
from metrale.formats import open_source
from tests.formats.gguf_util import GGUF_FIXTURES, rewrite

LLAMA = GGUF_FIXTURES / "llama.gguf"


def refused(path, *parts):
    """open_source(path) (and its metadata) raises a FormatError naming the file and parts."""
    with pytest.raises(FormatError) as e:
        open_source(path).metadata()
    msg = str(e.value)
    assert str(path) in msg, msg
    for part in parts:
        assert part in msg, msg
    return msg


SIZES = [
    ({"llama.block_count": 10**9},
     "llama.block_count = 1000000000 but the file holds tensors for 2 layers (blk.0 .. blk.1)"),
    ({"llama.block_count": 1}, "llama.block_count = 1 but the file holds tensors for 2 layers"),
    ({"llama.feed_forward_length": 10**9},
     "llama.feed_forward_length = 1000000000 but blk.0.ffn_gate.weight has 256 rows"),
    ({"llama.embedding_length": 2**30},
     "llama.embedding_length = 1073741824 but token_embd.weight has 64 columns"),
    ({"llama.vocab_size": 10**9}, "llama.vocab_size = 1000000000 but token_embd.weight has "
                                  "320 rows"),
    ({"llama.attention.head_count_kv": 10**6},
     "llama.attention.head_count_kv = 1000000 (x head_dim 16) = 16000000 but "
     "blk.0.attn_k.weight has 32 rows"),
    ({"llama.attention.head_count": 10**6},
     "llama.attention.head_count = 1000000 (x head_dim 0) = 0 but blk.0.attn_q.weight has "
     "64 rows"),
]


@pytest.mark.parametrize("keys, named", SIZES, ids=[next(iter(k)) for k, _ in SIZES])
def test_counts_and_sizes_are_checked_against_the_tensors(tmp_path, keys, named):
    """A size that disagrees with the tensor carrying it is refused by key while it is a
    number: block_count 10**9 used to build a per-layer table first (MemoryError), the
    others reached the memory plan ("needs 13 TB ... lower kv_blocks", no key named)."""
    p = rewrite(LLAMA, tmp_path / "m.gguf", keys)
    refused(p, named)


def test_a_gap_in_the_layers_is_named(tmp_path):
    p = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.block_count": 3},
                add_tensors={"blk.3.attn_norm.weight": [1.0] * 64})
    refused(p, "llama.block_count = 3 but the file holds tensors for layers blk.0 .. blk.3 "
               "without blk.2")


def nested(depth: int):
    """A value of `depth` levels of one-item arrays around a u32."""
    v = 7
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("depth", [9, 3000])
def test_deeply_nested_arrays_are_refused_by_key_and_limit(tmp_path, depth):
    """3000 levels used to end in a RecursionError; 9 is one over the limit of 8."""
    import sys
    from gguf import GGUFValueType
    from metrale.formats.gguf.file import MAX_ARRAY_DEPTH, GGUFFile
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 1000)    # for the gguf package's writer, which recurses
    try:
        p = rewrite(LLAMA, tmp_path / "m.gguf",
                    {"general.nested": (nested(depth), GGUFValueType.ARRAY)})
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(FormatError) as e:
        GGUFFile(p)
    msg = str(e.value)
    assert str(p) in msg and "'general.nested'" in msg and f"{MAX_ARRAY_DEPTH} deep" in msg


def test_nesting_within_the_limit_is_read(tmp_path):
    from gguf import GGUFValueType
    from metrale.formats.gguf.file import MAX_ARRAY_DEPTH, GGUFFile
    p = rewrite(LLAMA, tmp_path / "m.gguf",
                {"general.nested": (nested(MAX_ARRAY_DEPTH), GGUFValueType.ARRAY)})
    v = GGUFFile(p).fields["general.nested"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        v = v[0]
    assert list(v) == [7]


def llama_fields():
    from metrale.formats.gguf.file import GGUFFile
    return GGUFFile(LLAMA).fields


def a_merge_not_in(tokens: list[str]) -> str:
    """'a b' of two tokens whose concatenation is not a token."""
    vocab = set(tokens)
    return next(f"{a} {b}" for a in tokens[10:] for b in tokens[10:]
                if " " not in a + b and a + b not in vocab)


@pytest.mark.parametrize("merge, piece", [("zzq Ġ", "'zzq'"), ("Ġ zzr", "'zzr'"),
                                          (None, "")])
def test_merges_outside_the_vocabulary_are_refused_by_key(tmp_path, merge, piece):
    """Refused when the tokenizer is built: tokenizers raised a bare Exception ('Token `zzq`
    out of vocabulary'), or panicked when only the merged piece was missing."""
    tokens = llama_fields()["tokenizer.ggml.tokens"]
    merge = merge or a_merge_not_in(tokens)
    merges = list(llama_fields()["tokenizer.ggml.merges"]) + [merge]
    p = rewrite(LLAMA, tmp_path / "m.gguf", {"tokenizer.ggml.merges": merges})
    src = open_source(p)
    with pytest.raises(FormatError) as e:
        src.tokenizer()
    msg = str(e.value)
    assert str(p) in msg and f"tokenizer.ggml.merges entry {len(merges) - 1}" in msg
    assert piece in msg and "not in tokenizer.ggml.tokens" in msg


IDS = [("tokenizer.ggml.eos_token_id", 320), ("tokenizer.ggml.bos_token_id", 10**9),
       ("tokenizer.ggml.padding_token_id", 400), ("tokenizer.ggml.eot_token_id", 320),
       ("tokenizer.ggml.unknown_token_id", 10**6)]


@pytest.mark.parametrize("key, value", IDS, ids=[k.split(".")[-1] for k, _ in IDS])
def test_special_ids_outside_the_tokens_are_refused_at_open(tmp_path, key, value):
    """An EOS past the 320 tokens used to load (a generation could never stop on it)."""
    p = rewrite(LLAMA, tmp_path / "m.gguf", {key: value})
    refused(p, f"{key} = {value} is not a token id of tokenizer.ggml.tokens (320 tokens)")


def test_spm_unknown_id_past_the_tokens_is_a_format_error(tmp_path):
    """build_tokenizer indexed the token list with it: IndexError."""
    from metrale.formats.gguf.file import GGUFFile
    from metrale.formats.gguf.tokenizer import build_tokenizer
    p = rewrite(GGUF_FIXTURES / "spm_tokenizer.gguf", tmp_path / "t.gguf",
                {"tokenizer.ggml.unknown_token_id": 459})
    with pytest.raises(FormatError, match=r"t\.gguf: tokenizer\.ggml\.unknown_token_id = "
                                          r"459 is not a token id"):
        build_tokenizer(GGUFFile(p).fields, str(p))


def test_more_tokens_than_embedding_rows_are_refused_at_open(tmp_path):
    """Refused only at prefill before (token id >= vocab), naming neither file nor key."""
    f = llama_fields()
    p = rewrite(LLAMA, tmp_path / "m.gguf", {
        "tokenizer.ggml.tokens": list(f["tokenizer.ggml.tokens"]) + ["extra1", "extra2"],
        "tokenizer.ggml.token_type": ([int(t) for t in f["tokenizer.ggml.token_type"]]
                                      + [1, 1])})
    refused(p, "tokenizer.ggml.tokens holds 322 tokens but token_embd.weight has 320 rows")


def test_fewer_tokens_than_embedding_rows_load(tmp_path):
    """A padded embedding (llama.vocab_size = its rows, more than the tokens) is a valid
    file, as transformers reads it: 330 rows, 320 tokens."""
    import metrale
    import numpy as np
    rows = np.random.default_rng(0).standard_normal((330, 64)).astype(np.float32) * 0.02
    p = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.vocab_size": 330},
                drop_tensors=["token_embd.weight", "output.weight"],
                add_tensors={"token_embd.weight": rows})
    src = open_source(p)
    assert src.metadata().vocab_size == 330 and src.tokenizer().get_vocab_size() == 320
    model = metrale.load(src, "cpu", progress=False)
    assert model.metadata().vocab_size == 330


def test_unsupported_types_are_refused_by_the_files_type_with_counts(tmp_path):
    """An IQ2_XS file whose first tensor in file order is MXFP4 was refused as "tensor
    type MXFP4": the refusal names general.file_type and every unsupported type, most
    tensors first, with a count and a first tensor each (IQ4_NL / IQ4_XS, this test's
    first types, are read since issue 38)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from metrale.errors import Unsupported
    mx = np.zeros((64, 2 * 17), np.uint8)             # MXFP4: 32 elements in 17 B
    xs = np.zeros((64, 74), np.uint8)                 # IQ2_XS: 256 elements in 74 B
    p = rewrite(LLAMA, tmp_path / "m.gguf", {"general.file_type": 20},
                drop_tensors=["blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                              "blk.1.ffn_down.weight"],
                add_tensors={"blk.0.attn_q.weight": (mx, T.MXFP4),
                             "blk.0.ffn_down.weight": (xs, T.IQ2_XS),
                             "blk.1.ffn_down.weight": (xs, T.IQ2_XS)})
    with pytest.raises(Unsupported) as e:
        open_source(p)
    assert str(e.value).startswith(
        f"{p}: a MOSTLY_IQ2_XS file (general.file_type) holds tensor types metrale cannot "
        "read: IQ2_XS (2 tensors, e.g. blk.0.ffn_down.weight), MXFP4 (1 tensor, e.g. "
        "blk.0.attn_q.weight) (supported: F32, F16, BF16, Q4_0")


def with_type(src, dst, tensor: str, ggml_type: int):
    """A copy of GGUF `src` whose directory entry for 2-D `tensor` says `ggml_type` while
    its stored blocks stay as they are."""
    import struct
    b = bytearray(src.read_bytes())
    name = tensor.encode()
    at = b.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", b, at)[0] == 2
    struct.pack_into("<I", b, at + 4 + 2 * 8, ggml_type)
    dst.write_bytes(bytes(b))
    return dst


@pytest.mark.parametrize("tensor, ggml_type, what, stored, nxt", [
    ("blk.0.attn_k.weight", 3, "Q4_1 [32, 64]) takes 1280", 1152, "blk.0.attn_v.weight"),
    ("blk.0.ffn_down.weight", 10, "Q2_K [64, 256]) takes 5376", 9216,
     "blk.1.attn_norm.weight")])
def test_a_byte_count_that_does_not_match_type_and_shape_is_refused(tmp_path, tensor,
                                                                   ggml_type, what, stored,
                                                                   nxt):
    """A directory entry whose type makes the tensor's bytes more (Q4_0 blocks read as
    Q4_1: into the next tensor's bytes) or fewer (Q4_K as Q2_K: some of its own unread)
    than it holds loaded, and computed with other weights."""
    p = with_type(LLAMA, tmp_path / "t.gguf", tensor, ggml_type)
    refused(p, f"tensor {tensor!r} ({what} bytes by its type and shape, but {stored} bytes "
               f"lie between it and the next tensor {nxt!r}")
