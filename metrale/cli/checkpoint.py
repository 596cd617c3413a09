"""What the model-running subcommands share: opening MODEL, its tokenizer, the model."""
from __future__ import annotations


def open_checkpoint(spec: str):
    """The `ModelSource` of a MODEL value (directory, .safetensors or .gguf file,
    preset:NAME)."""
    from ..formats import open_source
    return open_source(spec)


def require_text_model(source, command: str) -> None:
    """Unsupported (exit 1) when `source` is a speech model: `command` (generate, ppl,
    embed) runs text models; transcription has its own command."""
    if source.metadata().architecture == "whisper":
        from ..errors import Unsupported
        raise Unsupported(f"{source.description}: this is a speech model: use metrale "
                          f"transcribe MODEL AUDIO.wav (metrale {command} runs text models)")


def load_model(source, device: str, **options):
    """The right model for `source` on `device` (`metrale.load`); options that are None
    are left at their defaults. A `max_seq_len` the model lowers (to the checkpoint's
    context or to its KV pool) is said on stderr."""
    from ..api import load
    from ..errors import OutOfMemory
    try:
        model = load(source, device, **{k: v for k, v in options.items() if v is not None})
    except OutOfMemory as e:   # the hint in this command's flags, not load options
        raise e.with_hint("lower --max-seq-len" if e.fits_without_kv else
                          "a quantized checkpoint (FP8, GPTQ or AWQ) would fit in less, or "
                          "a device with more free memory") from None
    asked = options.get("max_seq_len")
    if asked is not None:
        from ..engine.models import context_limit
        got = context_limit(model)
        if got is not None and got < asked:
            from .notes import note
            note(f"--max-seq-len {asked} lowered to {got}: {limit_reason(model, got)}")
    return model


def limit_reason(model, got: int) -> str:
    """Why a pointer-API model's context is `got` tokens: the checkpoint or its KV pool."""
    meta = model.metadata()
    context = meta.context_length or meta.max_position_embeddings
    if got >= context:
        how = "max_position_embeddings" if context == meta.max_position_embeddings else \
            "max_position_embeddings scaled by its rope_scaling"
        return f"the checkpoint's context is {context} positions ({how})"
    return (f"the KV pool holds {model.num_total_blocks()} blocks of {model.kv_block_size()} "
            "tokens")


def load_tokenizer(source):
    """The checkpoint's tokenizer.json through the `tokenizers` package (a GGUF file's own
    tokenizer, built from its metadata), or None when the checkpoint has none."""
    own = getattr(source, "tokenizer", None)
    if callable(own):
        return own()
    path = source.tokenizer_path()
    if path is None:
        return None
    from ..engine.chat import load_tokenizer as load_from_dir
    return load_from_dir(path.parent)


def text_tokenizer(source, what: str):
    """The tokenizer for text given with option `what` ("--prompt", "--text");
    InvalidArgument pointing to --ids when the checkpoint has no tokenizer.json."""
    tok = load_tokenizer(source)
    if tok is None:
        from ..errors import InvalidArgument
        raise InvalidArgument(f"{source.description} has no tokenizer.json, so {what} cannot "
                              "be tokenized; pass token ids with --ids 1,2,3")
    return tok
