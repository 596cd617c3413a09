"""`metrale embed MODEL`: embedding vectors (final-norm hidden states) of texts or token ids."""
from __future__ import annotations

import json

from .args import (add_device, add_max_seq_len, add_model, nonneg_int, token_ids,
                   utf8_option)
from .checkpoint import load_model, open_checkpoint, require_text_model, text_tokenizer


def register(sub) -> None:
    e = sub.add_parser("embed", help="embedding vectors of texts",
                       description="Embeddings from the final-norm hidden states: prints each "
                       "vector's norm and first values, or JSON.")
    add_model(e)
    ine = e.add_mutually_exclusive_group(required=True)
    ine.add_argument("--text", action="append", metavar="TEXT", type=utf8_option("--text"),
                     help="text to embed (repeatable)")
    ine.add_argument("--ids", type=token_ids, action="append", metavar="1,2,3",
                     help="token ids to embed (repeatable), when there is no tokenizer")
    e.add_argument("--pooling", choices=["last", "mean"], default="last",
                   help="last position (default) or mean over positions")
    e.add_argument("--no-normalize", action="store_true", help="keep the raw vector norm")
    e.add_argument("--show", type=nonneg_int, default=8, help="values to print (default 8)")
    e.add_argument("--json", action="store_true", help="print the vectors as JSON")
    add_max_seq_len(e)
    add_device(e)
    e.set_defaults(func=run)


def run(args) -> int:
    import numpy as np

    from ..engine import embed
    source = open_checkpoint(args.model)
    require_text_model(source, "embed")
    if args.ids is not None:
        batch = [list(x) for x in args.ids]
        labels = [",".join(map(str, x)) for x in batch]
    else:
        tok = text_tokenizer(source, "--text")
        batch = [tok.encode(t).ids for t in args.text]
        labels = list(args.text)
    model = load_model(source, args.device, max_seq_len=args.max_seq_len)
    try:
        check_lengths(model, batch, "--ids" if args.ids is not None else "--text",
                      args.max_seq_len)
        vecs = embed(model, batch, pooling=args.pooling, normalize=not args.no_normalize)
    finally:
        model.teardown()
    if args.json:
        print(json.dumps([{"input": lab, "norm": float(np.linalg.norm(v)),
                           "vector": [float(x) for x in v]} for lab, v in zip(labels, vecs)]))
        return 0
    for lab, v in zip(labels, vecs):
        first = " ".join(f"{x:+.4f}" for x in v[:args.show])
        short = lab if len(lab) <= 40 else lab[:37] + "..."
        print(f"{short!r}: dim {v.shape[0]}, norm {float(np.linalg.norm(v)):.4f}, "
              f"first [{first}]")
    return 0


def check_lengths(model, batch, flag: str, asked: int | None) -> None:
    """InvalidArgument, before anything runs, for an input longer than the model's context:
    which input, its length, the limit and what sets it."""
    from ..engine.models import context_limit
    from ..errors import InvalidArgument
    from .checkpoint import limit_reason
    limit = context_limit(model)
    meta = model.metadata()
    context = meta.context_length or meta.max_position_embeddings
    for i, ids in enumerate(batch, 1):
        if limit is None or len(ids) <= limit:
            continue
        what = f"{flag} input {i} is {len(ids)} tokens"
        if asked == limit and limit < context:
            raise InvalidArgument(f"{what}, longer than --max-seq-len {asked}: raise it (up "
                                  f"to {context}) or shorten the input")
        raise InvalidArgument(f"{what}, longer than the model's context of {limit} tokens: "
                              f"{limit_reason(model, limit)}; shorten the input")
