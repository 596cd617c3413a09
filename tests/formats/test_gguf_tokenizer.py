"""Tokenizers built from GGUF metadata (formats/gguf/tokenizer.py) against transformers'
GGUF tokenizer on the same files (goldens in tests/fixtures/gguf/tokenizers.json): byte-
level BPE with the llama3 and qwen2 splits, SentencePiece BPE with merges from scores,
special and added tokens, BOS, decoding; and llama.cpp's rules where HF's differ."""
from __future__ import annotations

import json

import pytest

from metrale.errors import Unsupported
from metrale.formats.gguf.file import GGUFFile
from metrale.formats.gguf.tokenizer import PRE_SPLITS, build_tokenizer
from tests.formats.gguf_util import GGUF_FIXTURES, rewrite

GOLDEN = json.loads((GGUF_FIXTURES / "tokenizers.json").read_text(encoding="utf-8"))


def tokenizer(name: str):
    return build_tokenizer(GGUFFile(GGUF_FIXTURES / f"{name}.gguf").fields, name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "spm_tokenizer"])
def test_ids_equal_transformers(name):
    tok = tokenizer(name)
    for text, want in GOLDEN[name]["texts"].items():
        if name == "spm_tokenizer" and text[:1].isspace():
            continue   # HF's conversion drops the dummy prefix here: the test below
        assert tok.encode(text).ids == want, (name, text)


def test_spm_text_starting_with_a_space_keeps_the_dummy_prefix():
    """' ' + text, as llama.cpp and SentencePiece's add_dummy_prefix: one '\u2581' more
    than HF's conversion gives (it prepends only where the text has no leading space)."""
    tok = tokenizer("spm_tokenizer")
    text = "  leading spaces"
    hf = GOLDEN["spm_tokenizer"]["texts"][text]
    ours = tok.encode(text)
    assert ours.tokens[:4] == ["<s>", "\u2581", "\u2581", "\u2581"]
    assert ours.ids[2:] == hf[1:] and ours.ids[:2] == [1, tok.token_to_id("\u2581")]


@pytest.mark.parametrize("name", ["llama", "spm_tokenizer"])
def test_decode_round_trips(name):
    tok = tokenizer(name)
    for text in GOLDEN[name]["texts"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids,
                          skip_special_tokens=False) == text, text


def test_control_tokens_are_special_and_whole():
    tok = tokenizer("llama")
    ids = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user"


def test_spm_adds_bos_and_a_space_prefix():
    tok = tokenizer("spm_tokenizer")
    enc = tok.encode("the rain")
    assert enc.ids[0] == 1 and enc.tokens[1].startswith("\u2581")
    assert tok.decode(enc.ids, skip_special_tokens=True) == "the rain"


def test_spm_prefix_after_special_tokens_follows_llama_cpp():
    """llama.cpp puts a '\u2581' before the text after every special token (HF's GGUF
    conversion only at the very start): "</s>the" tokenizes as "</s>" + " the"."""
    tok = tokenizer("spm_tokenizer")
    enc = tok.encode("</s>the", add_special_tokens=False)
    assert enc.ids == [2] + tok.encode("the", add_special_tokens=False).ids
    assert enc.tokens[1].startswith("\u2581")


def test_spm_without_space_prefix(tmp_path):
    p = rewrite(GGUF_FIXTURES / "spm_tokenizer.gguf", tmp_path / "t.gguf",
                {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token":
                 False})
    tok = build_tokenizer(GGUFFile(p).fields, "t")
    enc = tok.encode("the")
    assert enc.ids[0] != 1 and not enc.tokens[0].startswith("\u2581")


def test_unknown_pre_tokenizer_and_model_are_refused(tmp_path):
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "p.gguf",
                {"tokenizer.ggml.pre": "deepseek-coder"})
    with pytest.raises(Unsupported, match="tokenizer.ggml.pre 'deepseek-coder'"):
        build_tokenizer(GGUFFile(p).fields, "p")
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "m.gguf",
                {"tokenizer.ggml.model": "bert"})
    with pytest.raises(Unsupported, match="tokenizer.ggml.model 'bert'"):
        build_tokenizer(GGUFFile(p).fields, "m")


def test_digit_splitting_pres_split_digits_first():
    """`smollm` and its group split every digit off before the GPT-2 regex (llama.cpp);
    the plain gpt-2 split does not."""
    assert PRE_SPLITS["smollm"][0][0] == r"\p{N}"
    assert PRE_SPLITS["gpt-2"][0] == PRE_SPLITS["smollm"][0][1:]
