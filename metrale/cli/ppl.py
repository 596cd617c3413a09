"""`metrale ppl MODEL`: perplexity of a text file or of token ids, with a sliding window."""
from __future__ import annotations

import argparse
import codecs
import json
from pathlib import Path

from .args import add_device, add_ids, add_max_seq_len, add_model, existing_file, positive_int
from .checkpoint import load_model, open_checkpoint, require_text_model, text_tokenizer


def register(sub) -> None:
    pp = sub.add_parser("ppl", help="perplexity of a text file",
                        description="Perplexity of a text file (tokenized with the "
                        "checkpoint's tokenizer.json) or of token ids, with a sliding window "
                        "(Hugging Face's strided evaluation): every token after the first is "
                        "scored exactly once, with as much context as the window allows.")
    add_model(pp)
    inp = pp.add_mutually_exclusive_group(required=True)
    inp.add_argument("--text", type=existing_file, metavar="FILE",
                     help="text file (UTF-8 unless --encoding says otherwise)")
    add_ids(inp, "token ids, when the checkpoint has no tokenizer")
    pp.add_argument("--window", type=positive_int, default=None,
                    help="tokens per forward context (default: the whole text or max_seq_len)")
    pp.add_argument("--stride", type=positive_int, default=None,
                    help="window step (default: the window; consecutive windows always "
                         "overlap by at least one token)")
    pp.add_argument("--encoding", type=encoding, default="utf-8", metavar="NAME",
                    help="the --text file's encoding, a Python codec name such as latin-1 or "
                         "cp1252 (default utf-8; a byte-order mark is skipped); bytes it "
                         "cannot decode are refused with their offset")
    pp.add_argument("--json", action="store_true", help="print JSON")
    add_max_seq_len(pp)
    add_device(pp)
    pp.set_defaults(func=run)


def run(args) -> int:
    from ..engine import perplexity_details
    source = open_checkpoint(args.model)
    require_text_model(source, "ppl")
    from ..errors import InvalidArgument
    if args.ids is not None:
        ids = list(args.ids)
        if len(ids) < 2:
            raise InvalidArgument("--ids gives 1 token; perplexity needs at least 2 (every "
                                  "token after the first is scored)")
    else:
        tok = text_tokenizer(source, "--text")
        text = read_text(args.text, args.encoding)
        if not text:
            raise InvalidArgument(f"--text {args.text} is empty: there is nothing to score")
        ids = tok.encode(text).ids
        if len(ids) < 2:
            raise InvalidArgument(f"--text {args.text} is {len(ids)} token(s) long (BOS "
                                  "included): perplexity needs at least 2, as every token "
                                  "after the first is scored; give a longer text")
    model = load_model(source, args.device, max_seq_len=args.max_seq_len)
    from ..progress import Ticker
    ticker = Ticker("ppl")   # a line every few seconds once scoring has taken two
    try:
        r = perplexity_details(model, ids, window=args.window, stride=args.stride,
                               on_progress=lambda done, total: ticker.tick(
                                   f"{done:,} of {total:,} tokens scored"))
    finally:
        model.teardown()
    ticker.done(f"{r.tokens_scored:,} tokens scored")
    if args.json:
        print(json.dumps({"model": source.description, "tokens": len(ids),
                          "tokens_scored": r.tokens_scored, "perplexity": r.perplexity,
                          "nll": r.nll, "windows": r.windows, "window": r.window,
                          "step": r.step}))
    else:
        print(f"perplexity {r.perplexity:.4f} over {r.tokens_scored} scored "
              f"token{'s' if r.tokens_scored != 1 else ''} "
              f"({len(ids)} tokens, the first has no context; {r.windows} window"
              f"{'s' if r.windows != 1 else ''} of up to {r.window}, step {r.step})")
    return 0


def encoding(text: str) -> str:
    try:
        return codecs.lookup(text).name
    except LookupError:
        raise argparse.ArgumentTypeError(f"unknown encoding {text!r} (Python codec names: "
                                         "utf-8, latin-1, cp1252, utf-16, ...)") from None


def read_text(path: str, enc: str) -> str:
    """The file decoded strictly (a UTF-8 byte-order mark skipped); InvalidArgument naming
    the file and the byte offset of the first byte that does not decode."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig" if enc == "utf-8" else enc)
    except UnicodeDecodeError as e:
        from ..errors import InvalidArgument
        bad = data[e.start:e.start + 4].hex(" ")
        raise InvalidArgument(f"--text {path}: not valid {enc} at byte offset {e.start} "
                              f"(bytes {bad}: {e.reason}); give the file's encoding with "
                              "--encoding NAME (e.g. latin-1, cp1252) or convert it to "
                              "UTF-8") from None
