"""`metrale generate MODEL [PROMPT]`: generate after a prompt (plain or through the
checkpoint's chat template), token ids, and for LLaVA images, printing text as it comes;
with `--lora NAME=DIR ... --adapter NAME`, under a LoRA adapter."""
from __future__ import annotations

import argparse
import sys

from .args import (add_device, add_ids, add_max_seq_len, add_model, existing_file,
                   nonneg_float, nonneg_int, positive_float, positive_int, resolve_model,
                   top_p, utf8_option, utf8_text)
from .checkpoint import (load_model, load_tokenizer, open_checkpoint, require_text_model,
                         text_tokenizer)
from .lora_args import add_lora, lora_load_options
from .notes import note

DEFAULT_MAX_NEW = 64
# vLLM's SamplingParams default, used when sampling flags ask for sampling and neither
# --temperature nor generation_config.json gives a temperature
VLLM_TEMPERATURE = 1.0


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                       description="Generate after a prompt (tokenized with the checkpoint's "
                       "tokenizer.json; with --chat wrapped in its chat template), after "
                       "token ids, and on a LLaVA checkpoint after images (--image); prints "
                       "text as it comes. Sampling settings not given here come from the "
                       "checkpoint's generation_config.json (greedy unless it sets "
                       "do_sample); --top-k, --top-p, --min-p or --seed without a "
                       "temperature sample at generation_config.json's temperature, else 1 "
                       "(vLLM's default).")
    add_model(g)
    g.add_argument("prompt_text", nargs="?", metavar="PROMPT",
                   help="prompt text (the same as --prompt TEXT)")
    g.add_argument("--prompt", metavar="TEXT", type=utf8_option("--prompt"),
                   help="prompt text")
    add_ids(g, "prompt token ids, when the checkpoint has no tokenizer")
    g.add_argument("--image", action="append", type=existing_file, metavar="FILE",
                   help="an image (PNG, JPEG, ... through Pillow) for a LLaVA checkpoint, "
                        "repeatable; each fills an <image> placeholder of the prompt, in "
                        "order (without placeholders the images go first)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the checkpoint's chat "
                        "template (chat_template.jinja, else tokenizer_config.json's "
                        "chat_template; a .gguf file's tokenizer.chat_template)")
    g.add_argument("--system", metavar="TEXT", type=utf8_option("--system"),
                   help="a system message before the prompt (with --chat)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="most tokens to generate (default: generation_config.json's "
                        f"max_new_tokens, else {DEFAULT_MAX_NEW})")
    g.add_argument("--temperature", type=nonneg_float, default=None,
                   help="0 is greedy (default: generation_config.json, else 0; 1 when a "
                        "sampling flag below is given)")
    g.add_argument("--top-k", type=nonneg_int, default=None, help="0 keeps every token")
    g.add_argument("--top-p", type=top_p, default=None, help="nucleus mass in (0, 1]")
    g.add_argument("--min-p", type=min_p, default=None,
                   help="drop tokens below min_p x the top probability, in [0, 1]")
    g.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="1 is off (HF rule; applies greedy or sampled)")
    g.add_argument("--seed", type=nonneg_int, default=None, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's eos ids")
    add_lora(g, generate=True)
    add_max_seq_len(g)
    add_device(g)
    g.set_defaults(func=run, resolve=resolve_inputs, takes_more_positionals=True)


def min_p(text: str) -> float:
    v = nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1]")
    return v


def resolve_inputs(args) -> None:
    """MODEL [PROMPT] (or PROMPT with --model MODEL) into args.model and args.prompt; exactly
    one of PROMPT, --prompt and --ids."""
    given = [x for x in (args.model, args.prompt_text) if x is not None] + \
        args.more_positionals
    if args.model_option is not None:
        given.insert(0, args.model_option)
    if len(given) > 2:
        raise argparse.ArgumentTypeError(f"expected metrale generate MODEL [PROMPT], got "
                                         f"{len(given)} arguments: {given!r} (quote a prompt "
                                         "with spaces)")
    args.model = given[0] if given else None
    positional = given[1] if len(given) == 2 else None
    args.model_option = None
    resolve_model(args)
    sources = [name for name, v in (("PROMPT", positional), ("--prompt", args.prompt),
                                    ("--ids", args.ids)) if v is not None]
    if len(sources) != 1:
        raise argparse.ArgumentTypeError(
            "give the prompt once: metrale generate MODEL \"text\", --prompt TEXT or --ids "
            f"1,2,3{'' if not sources else ' (got ' + ' and '.join(sources) + ')'}")
    if positional is not None:
        args.prompt = utf8_text(positional, "PROMPT")
    args.lora_options = lora_load_options(args)


def prompt_ids(args, source, images: int):
    """(prompt token ids, tokenizer or None) for the prompt / --chat / --ids, with `images`
    <image> placeholders expanded to image-token spans (LLaVA)."""
    from ..errors import InvalidArgument
    from .images import chat_text, encode_with_images, ids_with_image_spans, with_placeholders
    if (args.chat or args.system) and args.prompt is None:
        raise InvalidArgument("--chat and --system need a prompt (the user message)")
    if args.system and not args.chat:
        raise InvalidArgument("--system needs --chat (it is a chat-template message)")
    if args.ids is not None:   # (the tokenizer still decodes the output)
        ids = list(args.ids)
        if images:
            ids = ids_with_image_spans(ids, images, source.metadata())
        return ids, load_tokenizer(source)
    tok = text_tokenizer(source, "the prompt")
    if args.chat:   # the template writes every special token itself
        # a GGUF source carries its template and tokenizer; others: the tokenizer's dir
        owner = source if callable(getattr(source, "chat_template", None)) else \
            source.tokenizer_path().parent
        text = chat_text(owner, args.system, args.prompt, images)
        special = False
    else:
        text = with_placeholders(args.prompt, images) if images else args.prompt
        special = True
    if images:
        return encode_with_images(tok, text, source.metadata().vision, special), tok
    return tok.encode(text, add_special_tokens=special).ids, tok


def sampling_settings(args, source, defaults):
    """SamplingParams from the flags over generation_config.json, and the notes for stderr.

    Sampling flags (--top-k, --top-p, --min-p, --seed) without --temperature where the
    checkpoint's defaults are greedy sample at generation_config.json's temperature, else
    at 1 (vLLM's default); with a temperature of 0 they are ignored, and said so."""
    flags = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p),
                            ("--min-p", args.min_p), ("--seed", args.seed)) if v is not None]
    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                 seed=args.seed)
    notes = []
    if flags and args.temperature is None and defaults.sampling_params().is_greedy:
        t = (source.generation_config() or {}).get("temperature")
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf")
        given["temperature"] = float(t) if ok else VLLM_TEMPERATURE
        where = "generation_config.json's temperature" if ok else "vLLM's default"
        notes.append(f"{' and '.join(flags)} given without --temperature: sampling at "
                     f"temperature {given['temperature']:g} ({where}; --temperature 0 for "
                     "greedy decoding)")
    sampling = defaults.sampling_params(**given)
    if flags and sampling.is_greedy:
        notes.append(f"{' and '.join(flags)} ignored: temperature 0 decodes greedily")
    return sampling, notes


def run(args) -> int:
    from ..engine import StreamDetokenizer, generate, generation_defaults
    from .images import check_images, load_images
    source = open_checkpoint(args.model)
    require_text_model(source, "generate")
    paths = args.image or []
    check_images(source, paths, args.prompt)
    ids, tok = prompt_ids(args, source, len(paths))
    images = load_images(source, paths) if paths else None
    if source.metadata().vision is not None and not paths:
        note("no --image given: the LLaVA model runs text-only")
    defaults = generation_defaults(source.generation_config())
    sampling, notes = sampling_settings(args, source, defaults)
    for n in notes:
        note(n)
    max_new = args.max_new_tokens or defaults.new_tokens(len(ids), DEFAULT_MAX_NEW)
    model = load_model(source, args.device, max_seq_len=args.max_seq_len, **args.lora_options)
    text = StreamDetokenizer(tok) if tok is not None else None
    printed = []

    def on_token(t: int) -> None:
        piece = f"{t} " if text is None else text.push(t)
        sys.stdout.write(piece)
        sys.stdout.flush()
        printed.append(t)

    try:
        res = generate(model, ids, max_new, sampling,
                       stop_token_ids=[] if args.ignore_eos else None, on_token=on_token,
                       images=images, **({"adapter": args.adapter} if args.adapter else {}))
    except KeyboardInterrupt:
        if printed:    # end the streamed line before `metrale: interrupted`
            sys.stdout.write((text.finish() if text is not None else "") + "\n")
            sys.stdout.flush()
        # one line from `main`: "metrale: interrupted after N tokens"
        raise KeyboardInterrupt(f"after {len(printed)} tokens") from None
    finally:
        model.teardown()
    sys.stdout.write((text.finish() if text is not None else "") + "\n")
    sys.stdout.flush()
    why = res.finish_reason + (": the context limit" if res.extra.get("context_limit") else "")
    mode = "greedy" if sampling.is_greedy else (
        f"temperature {sampling.temperature:g}, top_k {sampling.top_k}, top_p "
        f"{sampling.top_p:g}" + (f", min_p {sampling.min_p:g}" if sampling.min_p else ""))
    imgs = f"; {len(paths)} image{'s' if len(paths) != 1 else ''}" if paths else ""
    imgs += f"; LoRA adapter {args.adapter}" if args.adapter else ""
    print(f"{len(res.tokens)} tokens ({why}); {len(ids)} prompt tokens{imgs}; "
          f"{mode}; TTFT {res.ttft_s * 1e3:.1f} ms; decode {res.decode_tokens_per_s:.1f} "
          "tokens/s", file=sys.stderr)
    return 0
