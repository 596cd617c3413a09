"""Text in and out (issue 14 items 1 and 6): the streaming detokenizer never shows a broken
character and never loses text; chat templates render as transformers renders them, with
exactly one BOS; generation_config.json gives the sampling defaults."""
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

from metrale import FormatError, InvalidArgument
from metrale.engine import (SamplingParams, StreamDetokenizer, apply_chat_template,
                            generation_defaults, render_chat_template)
from tests.model.common import FIXTURES

TOKDIR = FIXTURES / "tokenizer"
TEXTS = ["é", "café au lait", "中文", "Hello 中文 world", "🙂", "a🙂b é中🙂", "ﬁ ß Ω ∑ 𝄞"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKDIR / "tokenizer.json"))


def stream(tok, ids):
    d = StreamDetokenizer(tok)
    pieces = [d.push(t) for t in ids]
    return pieces, d.finish(), d


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_split_across_tokens(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.replace(" ", ""))    # the characters really are split
    pieces, rest, d = stream(tok, ids)
    assert "".join(pieces) + rest == text and rest == ""
    assert not any("\ufffd" in p for p in pieces)
    assert d.text == text


def test_nothing_is_shown_until_a_character_is_complete(tok):
    ids = tok.encode("中", add_special_tokens=False).ids
    assert len(ids) == 3
    d = StreamDetokenizer(tok)
    assert [d.push(t) for t in ids] == ["", "", "中"]


def test_random_token_soup_streams_exactly_the_final_decode(tok):
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, 256, int(rng.integers(1, 40))).tolist()
        pieces, rest, d = stream(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids)
    # an incomplete character at the very end comes out (as decode writes it), not lost
    ids = tok.encode("ab中", add_special_tokens=False).ids[:-1]
    pieces, rest, _ = stream(tok, ids)
    assert "".join(pieces) == "ab" and rest == tok.decode(ids)[2:] and rest.startswith("\ufffd")


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("hi", add_special_tokens=False).ids + [3]
    pieces, rest, _ = stream(tok, ids)
    assert "".join(pieces) + rest == "hi"


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  Hi é 中文 🙂 "}]
# what transformers' apply_chat_template(..., tokenize=False) gives for the fixture's
# template: trim_blocks drops the newline after each block tag, lstrip_blocks the indent
# before it, the newline after a {{ }} expression stays
RENDERED = ("<s>\n<|system|>\nBe brief.<|end|>\n<|user|>\nHi é 中文 🙂<|end|>\n"
            "<|assistant|>\n")


def test_chat_template_renders_like_transformers():
    assert apply_chat_template(TOKDIR, MESSAGES, tokenize=False) == RENDERED
    no_prompt = apply_chat_template(TOKDIR, MESSAGES, add_generation_prompt=False,
                                    tokenize=False)
    assert no_prompt == RENDERED[:-len("<|assistant|>\n")]


def test_chat_template_has_exactly_one_bos(tok):
    ids = apply_chat_template(TOKDIR, MESSAGES)
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids == tok.encode(RENDERED, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED
    # the trap: the tokenizer's post-processor adds <s> too
    assert tok.encode(RENDERED).ids[:2] == [1, 1]
    roles = [tok.token_to_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")]
    assert all(r in ids for r in roles)


def test_chat_template_errors_and_features(tmp_path):
    with pytest.raises(InvalidArgument, match="roles must be system, user or assistant"):
        apply_chat_template(TOKDIR, [{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(InvalidArgument, match="non-empty list"):
        apply_chat_template(TOKDIR, [], tokenize=False)
    with pytest.raises(InvalidArgument, match="no chat template"):
        apply_chat_template(FIXTURES / "llama_gqa", MESSAGES)
    # tojson keeps non-ASCII and does not HTML-escape; loop controls; {% generation %};
    # extra variables; a chat_template.jinja file wins over tokenizer_config.json
    shutil.copy(TOKDIR / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}{{ flag }}")
    out = apply_chat_template(tmp_path, [{"role": "user", "content": "<é>"},
                                         {"role": "user", "content": "x"}],
                              tokenize=False, flag="!")
    assert out == '{"role": "user", "content": "<é>"}!'
    assert render_chat_template("{{ bos_token }}{{ messages[0].content }}",
                                [{"role": "user", "content": "a"}], bos_token="B") == "Ba"


def test_generation_config_defaults():
    greedy = generation_defaults({"temperature": 0.6, "top_p": 0.9})   # no do_sample
    assert greedy.sampling_params() == SamplingParams()
    d = generation_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                             "repetition_penalty": 1.1, "max_new_tokens": 7})
    assert d.sampling_params() == SamplingParams(temperature=0.6, top_k=50, top_p=0.9,
                                                 repetition_penalty=1.1)
    assert d.new_tokens(100, 64) == 7
    # the user's settings win; None means "not given"
    assert d.sampling_params(temperature=0.0, top_k=None).temperature == 0.0
    assert d.sampling_params(top_k=3).top_k == 3
    assert generation_defaults({"do_sample": True, "top_k": None}).sampling_params().top_k == 0
    assert generation_defaults({"max_length": 30}).new_tokens(10, 64) == 20
    assert generation_defaults(None).new_tokens(10, 64) == 64
    with pytest.raises(FormatError, match="temperature"):
        generation_defaults({"do_sample": True, "temperature": "hot"})


def test_generation_config_file_is_read(tmp_path):
    from metrale.formats import open_source
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_gqa", d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.7, top_k=20)
    (d / "generation_config.json").write_text(json.dumps(gen))
    defaults = generation_defaults(open_source(d).generation_config())
    assert defaults.sampling_params().temperature == 0.7


def test_gguf_paths_give_their_template_and_tokenizer():
    """A .gguf path is read as metrale.load and the CLI read it: the template from
    tokenizer.chat_template, the tokenizer from tokenizer.ggml.* (the file's folder holds
    neither: apply_chat_template looked there and failed, load_tokenizer gave None)."""
    from metrale.engine.chat import load_tokenizer
    from metrale.formats import open_source
    from tests.formats.gguf_util import GGUF_FIXTURES
    path = GGUF_FIXTURES / "llama.gguf"
    want = json.loads((GGUF_FIXTURES / "tokenizers.json").read_text())["llama"]["chat_ids"]
    msgs = [{"role": "user", "content": "Hello there"}]
    assert apply_chat_template(path, msgs) == want
    assert apply_chat_template(str(path), msgs) == apply_chat_template(open_source(path), msgs)
    assert apply_chat_template(path, msgs, tokenize=False).startswith("<|im_start|>user\n")
    tok = load_tokenizer(path)
    assert tok is not None and tok.encode("Hello there").ids == \
        open_source(path).tokenizer().encode("Hello there").ids
