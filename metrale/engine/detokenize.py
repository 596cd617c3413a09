"""Streaming detokenization: token ids in one at a time, text out as soon as it is final.

A byte-level BPE token can end in the middle of a UTF-8 character (é is two bytes, 中 three,
🙂 four), and decoding such a prefix gives U+FFFD in place of the missing bytes. The
detokenizer therefore decodes a short window of recent tokens twice — without and with the
new token — and emits only the new text, holding it back while it still ends in U+FFFD.
`finish()` returns whatever is still held, so the concatenation of every piece equals
`tokenizer.decode(all_ids)`: no text is lost, none is printed twice.

    stream = StreamDetokenizer(tokenizer)
    for t in ids:
        print(stream.push(t), end="")
    print(stream.finish())
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    """Incremental text of a growing token sequence.

    tokenizer: anything with `decode(ids, skip_special_tokens=...)` (a `tokenizers.Tokenizer`,
    a transformers tokenizer). skip_special_tokens: passed to every decode (True drops eos
    and the like from the text).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix:read] is the context window already turned into text; ids[read:] is
        # held back (its text still ends in an incomplete character)
        self._prefix = 0
        self._read = 0
        self.text = ""   # everything emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (often "", never partial)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(REPLACEMENT) or not after.startswith(before) \
                or len(after) <= len(before):
            # an incomplete character (or a decoder that rewrote the window's text):
            # wait for more tokens; finish() settles whatever is left
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end comes out as
        U+FFFD, as `decode` writes it). Afterwards `text == tokenizer.decode(ids)` whenever
        decoding is prefix-stable, as it is for byte-level BPE and SentencePiece."""
        full = self._decode(self.ids)
        rest = full[len(self.text):] if full.startswith(self.text) else \
            self._decode(self.ids[self._prefix:])[len(self._decode(
                self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        self.text += rest
        return rest
