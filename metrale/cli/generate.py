"""`metrale generate`: generate after a prompt or token ids, printing tokens as they come."""
from __future__ import annotations

import sys

from .args import add_device, add_ids, add_model, nonneg_float, nonneg_int, positive_int, top_p
from .checkpoint import load_model, load_tokenizer, open_checkpoint, text_tokenizer


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt, streaming tokens",
                       description="Generate after a prompt (tokenized with the checkpoint's "
                       "tokenizer.json; needs the tokenizers package) or after token ids; "
                       "prints tokens as they come.")
    add_model(g)
    ing = g.add_mutually_exclusive_group(required=True)
    ing.add_argument("--prompt", metavar="TEXT", help="prompt text")
    add_ids(ing, "prompt token ids, when the checkpoint has no tokenizer")
    g.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=nonneg_float, default=0.0,
                   help="0 is greedy (default 0)")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="0 keeps every token")
    g.add_argument("--top-p", type=top_p, default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--seed", type=nonneg_int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's eos ids")
    add_device(g)
    g.set_defaults(func=run)


def run(args) -> int:
    from ..engine import SamplingParams, generate
    source = open_checkpoint(args.model)
    if args.ids is not None:
        tok = load_tokenizer(source)  # still decodes the output when there is one
        ids = list(args.ids)
    else:
        tok = text_tokenizer(source, "--prompt")
        ids = tok.encode(args.prompt).ids
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    model = load_model(source, args.device)
    out: list[int] = []
    shown = [""]

    def on_token(t: int) -> None:
        out.append(int(t))
        if tok is None:
            sys.stdout.write(f"{t} ")
        else:
            text = tok.decode(out)
            if text.startswith(shown[0]):
                sys.stdout.write(text[len(shown[0]):])
                shown[0] = text
        sys.stdout.flush()

    try:
        res = generate(model, ids, args.max_new_tokens, sampling,
                       stop_token_ids=[] if args.ignore_eos else None, on_token=on_token)
    finally:
        model.teardown()
    sys.stdout.write("\n")
    print(f"{len(res.tokens)} tokens ({res.finish_reason}); TTFT {res.ttft_s * 1e3:.1f} ms; "
          f"decode {res.decode_tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0
