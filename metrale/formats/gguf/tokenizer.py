"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer.ggml.* metadata, splitting
text the way llama.cpp's tokenizer does (llama-vocab.cpp).

- `gpt2` (byte-level BPE): the vocabulary and merges of the file; the pre-tokenizer is the
  regex list llama.cpp uses for `tokenizer.ggml.pre` (PRE_SPLITS, each regex splitting the
  pieces of the one before, matches kept as pieces), then the byte-level alphabet;
  `llama3`-style files take a whole word that is in the vocabulary before any merge
  (llama.cpp's ignore_merges, the BPE model's `ignore_merges`). A `pre` llama.cpp does not
  list, or one not carried here, is refused by name: another split is another tokenization.
- `llama` (SentencePiece BPE): the vocabulary, the merges of the file or, without them,
  merges ranked by the tokens' scores (transformers' `generate_merges`), byte fallback
  through the <0xXX> tokens, and '\u2581' for spaces; with add_space_prefix (absent: true)
  a '\u2581' starts the text and the text after every special token, as llama.cpp (and
  SentencePiece's add_dummy_prefix) does, even where the text starts with a space.
- Control tokens (token_type 3) are special tokens and user-defined ones (4) added tokens,
  so both are matched whole in text; add_bos_token / add_eos_token become the
  post-processor of plain prompts (llama: BOS unless the file says otherwise).

Differences from transformers' GGUF tokenizer (tests/formats/test_gguf_tokenizer.py): HF
has no split for `smollm` (and the other digit-splitting pres), so before digits that
follow two or more spaces it merges differently ("x  1": HF ['x', 'Ġ', 'Ġ', '1'], llama.cpp
and SmolLM2's own tokenizer.json ['x', 'ĠĠ', '1']); HF's SentencePiece conversion puts
'\u2581' only at the very start (not after special tokens, and not before a leading space)
and ignores add_space_prefix.
"""
from __future__ import annotations

from functools import lru_cache

from ...errors import FormatError, Unsupported

CONTROL, USER_DEFINED = 3, 4

_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _group(names: str, regexes: tuple, ignore_merges: bool = False) -> dict:
    return {n: (regexes, ignore_merges) for n in names.split()}


# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges), from llama-vocab.cpp
PRE_SPLITS = {
    **_group("gpt-2 phi-2 mpt olmo jais jina-es jina-de jina-v2-es jina-v2-de gigachat "
             "exaone4", (_GPT2,)),
    **_group("smollm starcoder refact command-r codeshell exaone minerva-7b",
             (r"\p{N}", _GPT2)),
    **_group("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
             (_LLAMA3,), ignore_merges=True),
    **_group("dbrx smaug-bpe", (_LLAMA3,)),
    **_group("qwen2 deepseek-r1-qwen kormo megrez stablelm2", (_QWEN2,)),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def check_token_ids(fields: dict, where: str, rows: int | None = None) -> None:
    """FormatError naming the key unless every tokenizer.ggml.*_token_id (BOS, EOS, EOT,
    padding, unknown, fill-in-the-middle...) is an id of tokenizer.ggml.tokens (of the
    `rows` embedding rows without a token list), and the list has no more tokens than
    `rows`. Fewer tokens than rows is a padded embedding (a vocab_size key saying so),
    which transformers loads too."""
    tokens = fields.get("tokenizer.ggml.tokens")
    n = len(tokens) if isinstance(tokens, list) else None
    if n is not None and rows is not None and n > rows:
        raise FormatError(f"{where}: tokenizer.ggml.tokens holds {n} tokens but "
                          f"token_embd.weight has {rows} rows (one per token id): ids "
                          f"{rows} .. {n - 1} have no embedding")
    bound, what = (n, f"tokenizer.ggml.tokens ({n} tokens)") if n is not None else \
        (rows, f"the vocabulary ({rows} embedding rows)")
    if bound is None:
        return
    for key, v in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and (
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < bound):
            raise FormatError(f"{where}: {key} = {v!r} is not a token id of {what}")


def build_tokenizer(fields: dict, where: str):
    """The `tokenizers.Tokenizer` of a GGUF's metadata; None when it has no vocabulary."""
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model is None and tokens is None:
        return None
    if not isinstance(tokens, list) or not tokens:
        raise FormatError(f"{where}: tokenizer.ggml.tokens is missing or empty")
    check_token_ids(fields, where)
    types = fields.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise FormatError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries "
                          f"for {len(tokens)} tokens")
    if model == "gpt2":
        tok, byte_level = _byte_level_bpe(fields, tokens, where), True
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    elif model == "llama":
        tok, byte_level = _sentencepiece_bpe(fields, tokens, types, where), False
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise Unsupported(f"{where}: tokenizer.ggml.model {model!r} is not supported "
                          "(supported: gpt2, llama)")
    _add_special_tokens(tok, tokens, types, byte_level)
    _post_processor(tok, fields, tokens, add_bos,
                    bool(fields.get("tokenizer.ggml.add_eos_token", False)), where)
    return tok


def _merges(fields: dict, vocab: dict, where: str) -> list[tuple[str, str]]:
    """(left, right) pairs split at the first space after the first character (llama.cpp:
    a left part may itself be a space); both parts and their merge must be in `vocab`
    (the BPE model fails on them otherwise, without naming the file)."""
    merges = fields.get("tokenizer.ggml.merges") or []
    out = [(m[:i], m[i + 1:]) for m, i in zip(merges, (m.find(" ", 1) for m in merges))]
    bad = next((m for m, (a, b) in zip(merges, out) if len(a) + len(b) + 1 != len(m)), None)
    if bad is not None:
        raise FormatError(f"{where}: tokenizer.ggml.merges entry {bad!r} has no space")
    for i, (a, b) in enumerate(out):
        if a not in vocab or b not in vocab or a + b not in vocab:
            piece = next(x for x in (a, b, a + b) if x not in vocab)
            raise FormatError(f"{where}: tokenizer.ggml.merges entry {i} ({merges[i]!r}) "
                              f"names {piece!r}, which is not in tokenizer.ggml.tokens")
    return out


def _byte_level_bpe(fields: dict, tokens: list[str], where: str):
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in PRE_SPLITS:
        raise Unsupported(f"{where}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                          f"{', '.join(sorted(PRE_SPLITS))})")
    regexes, ignore_merges = PRE_SPLITS[pre]
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    if set("".join(tokens)) <= alphabet:      # the usual case, checked in one pass
        spelled = tokens
    else:   # a token outside the byte alphabet is spelled in it (HF's conversion does so)
        spelled = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
                   for t in tokens]
    # the first id of a duplicate wins: assigned last
    vocab = dict(zip(reversed(spelled), range(len(spelled) - 1, -1, -1)))
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(fields, vocab, where), dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(fields: dict, tokens: list[str], types: list[int], where: str):
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}   # first id of a duplicate
    merges = _merges(fields, vocab, where)
    if not merges:
        scores = fields.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise FormatError(f"{where}: a llama tokenizer needs tokenizer.ggml.merges or "
                              "one tokenizer.ggml.scores entry per token")
        merges = _merges_from_scores(vocab, {t: float(s) for t, s in zip(tokens, scores)})
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True,
                        byte_fallback=True,
                        unk_token=tokens[int(unk)] if unk is not None else None))
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # llama.cpp (and SentencePiece's add_dummy_prefix): ' ' + text, spaces -> '\u2581'; a
    # normalizer runs on each stretch of text between special tokens, so the prefix comes
    # after every special token too, and before text that starts with a space
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict, scores: dict) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored merged token first (ties: the
    shorter left piece; within a token, by the pieces' ids): transformers' generate_merges."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_special_tokens(tok, tokens: list[str], types: list[int], byte_level: bool) -> None:
    from tokenizers import AddedToken
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    # in a byte-level vocabulary a control token outside the alphabet is a mislabel that
    # could never be produced anyway (HF skips those too)
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types)
               if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        tok.add_tokens(user)


def _post_processor(tok, fields: dict, tokens: list[str], add_bos: bool, add_eos: bool,
                    where: str) -> None:
    from tokenizers import processors
    special, single = [], "$A:0"
    for key, on in (("bos", add_bos), ("eos", add_eos)):
        if not on:
            continue
        tid = fields.get(f"tokenizer.ggml.{key}_token_id")
        if tid is None or not 0 <= int(tid) < len(tokens):
            raise FormatError(f"{where}: tokenizer.ggml.add_{key}_token is set but "
                              f"tokenizer.ggml.{key}_token_id is missing or out of range")
        special.append((tokens[int(tid)], int(tid)))
        single = f"{tokens[int(tid)]}:0 {single}" if key == "bos" else \
            f"{single} {tokens[int(tid)]}:0"
    tok.post_processor = processors.TemplateProcessing(single=single,
                                                       special_tokens=special)
