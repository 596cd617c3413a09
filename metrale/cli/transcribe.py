"""`metrale transcribe MODEL AUDIO.wav`: speech to text with a Whisper checkpoint."""
from __future__ import annotations

import argparse
import json

from .args import MODEL_HELP, add_device, existing_file, model_spec, positive_int


def register(sub) -> None:
    t = sub.add_parser("transcribe", help="speech to text with a Whisper checkpoint",
                       description="Transcribe (or translate to English) a WAV file with a "
                       "Whisper checkpoint: PCM 8/16/24/32-bit or IEEE float 32/64-bit, any "
                       "sample rate (resampled to 16 kHz), several channels averaged to mono.")
    t.add_argument("inputs", nargs="*", metavar="MODEL AUDIO.wav",
                   help=f"the model ({MODEL_HELP}) and the audio file; with --model, only "
                        "the audio file")
    t.add_argument("--model", dest="model_option", metavar="MODEL",
                   help="the same as the positional MODEL")
    t.add_argument("--language", metavar="CODE",
                   help="spoken language, e.g. en or <|en|> (default: the checkpoint's "
                        "forced language, else detected)")
    t.add_argument("--task", choices=["transcribe", "translate"], default="transcribe",
                   help="transcribe (default) or translate to English")
    t.add_argument("--max-new-tokens", type=positive_int, default=224,
                   help="most tokens per 30 s window (default 224)")
    t.add_argument("--timestamps", action="store_true",
                   help="print each segment with its start and end time (needs a checkpoint "
                        "with timestamp tokens)")
    t.add_argument("--json", action="store_true", help="print JSON")
    add_device(t)
    t.set_defaults(func=run, resolve=resolve_inputs)


def resolve_inputs(args) -> None:
    """`MODEL AUDIO` or `AUDIO --model MODEL` into args.model and args.file (validated)."""
    given = list(args.inputs)
    if args.model_option is not None:
        given.insert(0, args.model_option)
    if len(given) != 2:
        raise argparse.ArgumentTypeError("expected metrale transcribe MODEL AUDIO.wav (or "
                                         "AUDIO.wav --model MODEL)")
    args.model = model_spec(given[0])
    args.file = existing_file(given[1])


def run(args) -> int:
    from ..audio import load_wav
    from ..engine.transcribe import transcribe
    from .checkpoint import load_model, load_tokenizer, open_checkpoint
    source = open_checkpoint(args.model)
    if source.metadata().architecture != "whisper":
        from ..errors import Unsupported
        raise Unsupported(f"{source.description}: transcribe needs a Whisper (speech) "
                          f"checkpoint, this is {source.metadata().architecture!r} (use "
                          "metrale generate)")
    tok = load_tokenizer(source)
    audio = load_wav(args.file)   # downmixed to mono, resampled to 16 kHz
    model = load_model(source, args.device)
    try:
        result = transcribe(model, audio, tokenizer=tok, language=args.language,
                            task=args.task, max_new_tokens=args.max_new_tokens,
                            timestamps=args.timestamps)
    finally:
        close = getattr(model, "close", None)
        if close is not None:
            close()
    if args.json:
        print(json.dumps({"file": args.file, "text": result.text, "tokens": result.tokens,
                          "language": result.language,
                          "segments": [{"start": s.start, "end": s.end, "text": s.text,
                                        "tokens": s.tokens} for s in result.segments]}))
        return 0
    if args.timestamps:
        for s in result.segments:
            body = s.text if s.text is not None else " ".join(map(str, s.tokens))
            print(f"[{s.start:7.2f} --> {s.end:7.2f}] {body.strip()}")
    elif result.text is not None:
        print(result.text)
    else:
        print(" ".join(str(t) for t in result.tokens))
    return 0
