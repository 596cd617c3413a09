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
