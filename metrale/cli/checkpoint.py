"""What the model-running subcommands share: opening `--model`, its tokenizer, the model."""
from __future__ import annotations


def open_checkpoint(spec: str):
    """The `ModelSource` of a `--model` value (directory, .safetensors file, preset:NAME)."""
    from ..formats import open_source
    return open_source(spec)


def load_model(source, device: str, **options):
    """The right model for `source` on `device` (`metrale.load`)."""
    from ..api import load
    return load(source, device, **options)


def load_tokenizer(source):
    """The checkpoint's tokenizer.json through the `tokenizers` package, or None when the
    checkpoint has none. Unsupported (exit 1) when it has one but the package is missing."""
    path = source.tokenizer_path()
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        from ..errors import Unsupported
        raise Unsupported(f"{path}: reading it needs the tokenizers package; pip install "
                          "'metrale[tokenizers]' (or pass token ids with --ids)") from None
    return Tokenizer.from_file(str(path))


def text_tokenizer(source, what: str):
    """The tokenizer for text given with option `what` ("--prompt", "--text");
    InvalidArgument pointing to --ids when the checkpoint has no tokenizer.json."""
    tok = load_tokenizer(source)
    if tok is None:
        from ..errors import InvalidArgument
        raise InvalidArgument(f"{source.description} has no tokenizer.json, so {what} cannot "
                              "be tokenized; pass token ids with --ids 1,2,3")
    return tok
