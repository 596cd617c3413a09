"""`metrale ppl MODEL`: perplexity of a text file or of token ids, with a sliding window."""
from __future__ import annotations

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
    inp.add_argument("--text", type=existing_file, metavar="FILE", help="UTF-8 text file")
    add_ids(inp, "token ids, when the checkpoint has no tokenizer")
    pp.add_argument("--window", type=positive_int, default=None,
                    help="tokens per forward context (default: the whole text or max_seq_len)")
    pp.add_argument("--stride", type=positive_int, default=None,
                    help="window step (default: the window; consecutive windows always "
                         "overlap by at least one token)")
    pp.add_argument("--json", action="store_true", help="print JSON")
    add_max_seq_len(pp)
    add_device(pp)
    pp.set_defaults(func=run)


def run(args) -> int:
    from ..engine import perplexity_details
    source = open_checkpoint(args.model)
    require_text_model(source, "ppl")
    if args.ids is not None:
        ids = list(args.ids)
    else:
        tok = text_tokenizer(source, "--text")
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text).ids
    if len(ids) < 2:
        from ..errors import InvalidArgument
        raise InvalidArgument(f"perplexity needs at least 2 tokens, got {len(ids)}")
    model = load_model(source, args.device, max_seq_len=args.max_seq_len)
    try:
        r = perplexity_details(model, ids, window=args.window, stride=args.stride)
    finally:
        model.teardown()
    if args.json:
        print(json.dumps({"model": source.description, "tokens": len(ids),
                          "tokens_scored": r.tokens_scored, "perplexity": r.perplexity,
                          "nll": r.nll, "windows": r.windows, "window": r.window,
                          "step": r.step}))
    else:
        print(f"perplexity {r.perplexity:.4f} over {r.tokens_scored} scored tokens "
              f"({len(ids)} tokens, the first has no context; {r.windows} window"
              f"{'s' if r.windows != 1 else ''} of up to {r.window}, step {r.step})")
    return 0
