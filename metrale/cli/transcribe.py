"""`metrale transcribe`: speech to text of a .wav file with a Whisper checkpoint."""
from __future__ import annotations

import json

from .args import add_device, add_model, existing_file
from .checkpoint import load_model, load_tokenizer, open_checkpoint


def register(sub) -> None:
    t = sub.add_parser("transcribe", help="speech to text with a Whisper checkpoint",
                       description="Transcribe a .wav file with a Whisper checkpoint.")
    t.add_argument("file", type=existing_file, metavar="FILE.wav", help="audio file")
    add_model(t)
    t.add_argument("--json", action="store_true", help="print JSON")
    add_device(t)
    t.set_defaults(func=run)


def run(args) -> int:
    from ..errors import MetraleError, Unsupported
    try:
        from ..audio import load_wav
        from ..engine.transcribe import transcribe
    except ImportError as e:
        raise Unsupported(f"transcription is not available in this build ({e})") from None
    source = open_checkpoint(args.model)
    tok = load_tokenizer(source)
    try:
        audio = load_wav(args.file)
    except MetraleError:
        raise
    except Exception as e:  # wave.Error, EOFError, ValueError...: a bad file, one line
        from ..errors import FormatError
        raise FormatError(f"{args.file}: cannot read as WAV audio ({type(e).__name__}: "
                          f"{e})") from None
    model = load_model(source, args.device)
    try:
        result = transcribe(model, audio, tokenizer=tok)
    finally:
        teardown = getattr(model, "teardown", None)
        if teardown is not None:
            teardown()
    text = result if isinstance(result, str) else getattr(result, "text", None)
    if args.json:
        tokens = getattr(result, "tokens", None)
        print(json.dumps({"file": args.file, "text": text,
                          "tokens": list(tokens) if tokens is not None else None}))
    elif text is not None:
        print(text)
    else:
        tokens = getattr(result, "tokens", result)
        print(" ".join(str(t) for t in tokens))
    return 0
