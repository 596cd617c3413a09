"""`metrale generate MODEL`: generate after a prompt (plain or through the checkpoint's chat
template) or token ids, printing text as it comes."""
from __future__ import annotations

import sys

from .args import (add_device, add_ids, add_max_seq_len, add_model, nonneg_float, nonneg_int,
                   positive_float, positive_int, top_p)
from .checkpoint import (load_model, load_tokenizer, open_checkpoint, require_text_model,
                         text_tokenizer)

DEFAULT_MAX_NEW = 64


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                       description="Generate after a prompt (tokenized with the checkpoint's "
                       "tokenizer.json; with --chat wrapped in its chat template) or after "
                       "token ids; prints text as it comes. Sampling settings not given "
                       "here come from the checkpoint's generation_config.json (greedy "
                       "unless it sets do_sample).")
    add_model(g)
    ing = g.add_mutually_exclusive_group(required=True)
    ing.add_argument("--prompt", metavar="TEXT", help="prompt text")
    add_ids(ing, "prompt token ids, when the checkpoint has no tokenizer")
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the checkpoint's chat "
                        "template (tokenizer_config.json's chat_template)")
    g.add_argument("--system", metavar="TEXT", help="a system message before the prompt "
                   "(with --chat)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="most tokens to generate (default: generation_config.json's "
                        f"max_new_tokens, else {DEFAULT_MAX_NEW})")
    g.add_argument("--temperature", type=nonneg_float, default=None,
                   help="0 is greedy (default: generation_config.json, else 0)")
    g.add_argument("--top-k", type=nonneg_int, default=None, help="0 keeps every token")
    g.add_argument("--top-p", type=top_p, default=None, help="nucleus mass in (0, 1]")
    g.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="1 is off (HF rule)")
    g.add_argument("--seed", type=nonneg_int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's eos ids")
    add_max_seq_len(g)
    add_device(g)
    g.set_defaults(func=run)


def prompt_ids(args, source):
    """(prompt token ids, tokenizer or None) for --prompt / --chat / --ids."""
    from ..errors import InvalidArgument
    if (args.chat or args.system) and args.prompt is None:
        raise InvalidArgument("--chat and --system need --prompt TEXT (the user message)")
    if args.system and not args.chat:
        raise InvalidArgument("--system needs --chat (it is a chat-template message)")
    if args.ids is not None:
        return list(args.ids), load_tokenizer(source)   # still decodes the output
    tok = text_tokenizer(source, "--prompt")
    if not args.chat:
        return tok.encode(args.prompt).ids, tok
    from ..engine.chat import apply_chat_template
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return apply_chat_template(source.tokenizer_path().parent, messages, tokenizer=tok), tok


def run(args) -> int:
    from ..engine import StreamDetokenizer, generate, generation_defaults
    source = open_checkpoint(args.model)
    require_text_model(source, "generate")
    ids, tok = prompt_ids(args, source)
    defaults = generation_defaults(source.generation_config())
    sampling = defaults.sampling_params(temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p,
                                        repetition_penalty=args.repetition_penalty,
                                        seed=args.seed)
    max_new = args.max_new_tokens or defaults.new_tokens(len(ids), DEFAULT_MAX_NEW)
    model = load_model(source, args.device, max_seq_len=args.max_seq_len)
    text = StreamDetokenizer(tok) if tok is not None else None

    def on_token(t: int) -> None:
        sys.stdout.write(f"{t} " if text is None else text.push(t))
        sys.stdout.flush()

    try:
        res = generate(model, ids, max_new, sampling,
                       stop_token_ids=[] if args.ignore_eos else None, on_token=on_token)
    finally:
        model.teardown()
    sys.stdout.write((text.finish() if text is not None else "") + "\n")
    sys.stdout.flush()
    why = res.finish_reason + (": the context limit" if res.extra.get("context_limit") else "")
    mode = "greedy" if sampling.is_greedy else (
        f"temperature {sampling.temperature:g}, top_k {sampling.top_k}, top_p "
        f"{sampling.top_p:g}")
    print(f"{len(res.tokens)} tokens ({why}); {len(ids)} prompt tokens; "
          f"{mode}; TTFT {res.ttft_s * 1e3:.1f} ms; decode {res.decode_tokens_per_s:.1f} "
          "tokens/s", file=sys.stderr)
    return 0
