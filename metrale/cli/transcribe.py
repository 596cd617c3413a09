"""`metrale transcribe MODEL AUDIO.wav [AUDIO.wav ...]`: speech to text with a Whisper
checkpoint, the model loaded once for every file."""
from __future__ import annotations

import argparse
import json
import sys

from .args import MODEL_HELP, add_device, existing_file, model_spec, positive_int


def register(sub) -> None:
    t = sub.add_parser("transcribe", help="speech to text with a Whisper checkpoint",
                       description="Transcribe (or translate to English) WAV files with a "
                       "Whisper checkpoint: PCM 8/16/24/32-bit or IEEE float 32/64-bit, any "
                       "sample rate (resampled to 16 kHz), several channels averaged to mono. "
                       "With several files each output line starts with the file's name "
                       "(FILE: text), and --json prints one JSON object per file and line. "
                       "A progress line per 30 s window goes to stderr.")
    t.add_argument("inputs", nargs="*", metavar="MODEL AUDIO.wav",
                   help=f"the model ({MODEL_HELP}) and one or more audio files; with "
                        "--model, only the audio files")
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
    t.set_defaults(func=run, resolve=resolve_inputs, takes_more_positionals=True)


def resolve_inputs(args) -> None:
    """`MODEL AUDIO...` or `AUDIO... --model MODEL` into args.model and args.files
    (validated)."""
    given = list(args.inputs) + args.more_positionals
    if args.model_option is not None:
        given.insert(0, args.model_option)
    if len(given) < 2:
        raise argparse.ArgumentTypeError("expected metrale transcribe MODEL AUDIO.wav "
                                         "[AUDIO.wav ...] (or AUDIO.wav ... --model MODEL)")
    args.model = model_spec(given[0])
    args.files = [existing_file(f) for f in given[1:]]


def run(args) -> int:
    from ..audio import N_SAMPLES, SAMPLE_RATE, load_wav
    from ..engine.transcribe import transcribe
    from .checkpoint import load_model, load_tokenizer, open_checkpoint
    from .notes import Progress
    source = open_checkpoint(args.model)
    if source.metadata().architecture != "whisper":
        from ..errors import Unsupported
        raise Unsupported(f"{source.description}: transcribe needs a Whisper (speech) "
                          f"checkpoint, this is {source.metadata().architecture!r} (use "
                          "metrale generate)")
    tok = load_tokenizer(source)
    audio = [load_wav(f) for f in args.files]   # each mono at 16 kHz; all read before loading
    progress = Progress("transcribe", sum(max(1, -(-a.size // N_SAMPLES)) for a in audio))
    model = load_model(source, args.device)
    from ..progress import Ticker
    try:
        for path, samples in zip(args.files, audio):
            def span(i, samples=samples):
                start = i * N_SAMPLES / SAMPLE_RATE
                return f"{start:.1f}-{min(samples.size, (i + 1) * N_SAMPLES) / SAMPLE_RATE:.1f} s"

            def on_window(i, n, segs, path=path):
                progress.step(f"{path} {span(i)}")
            # within a window: a line every few seconds once it has taken two
            ticker = Ticker(f"transcribe: {path}")

            def on_step(i, n, tokens, ticker=ticker):
                ticker.tick(f"{span(i)}: " + ("audio encoded" if tokens == 0 else
                                              f"{tokens} tokens decoded"))
            result = transcribe(model, samples, tokenizer=tok, language=args.language,
                                task=args.task, max_new_tokens=args.max_new_tokens,
                                timestamps=args.timestamps, on_window=on_window,
                                on_step=on_step)
            print_result(args, path, result, prefix=f"{path}: " if len(args.files) > 1 else "")
            sys.stdout.flush()   # each file's result as soon as it is done
    finally:
        close = getattr(model, "close", None)
        if close is not None:
            close()
    return 0


def print_result(args, path: str, result, prefix: str) -> None:
    """One file's result on stdout: a JSON line, timestamped segments or the text."""
    if args.json:
        print(json.dumps({"file": path, "text": result.text, "tokens": result.tokens,
                          "language": result.language,
                          "segments": [{"start": s.start, "end": s.end, "text": s.text,
                                        "tokens": s.tokens} for s in result.segments]}))
    elif args.timestamps:
        for s in result.segments:
            body = s.text if s.text is not None else " ".join(map(str, s.tokens))
            print(f"{prefix}[{s.start:7.2f} --> {s.end:7.2f}] {body.strip()}")
    elif result.text is not None:
        print(prefix + result.text)
    else:
        print(prefix + " ".join(str(t) for t in result.tokens))
