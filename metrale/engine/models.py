"""What the engine functions accept: a `TransformerModel` or a `GenerativeModel`."""
from __future__ import annotations

from ..errors import InvalidArgument, Unsupported

SPEECH_MODEL = ("this is a speech model: use metrale.engine.transcribe.transcribe (from the "
                "command line: metrale transcribe MODEL AUDIO.wav)")


def _expected(model):
    from ..generative import SpeechToTextModel
    if isinstance(model, SpeechToTextModel):
        return Unsupported(f"{type(model).__name__}: {SPEECH_MODEL}")
    return InvalidArgument(f"expected a TransformerModel (metrale.load) or a GenerativeModel "
                           f"(metrale.load_generative), got {type(model).__name__}")


def pointer_model(model):
    """The `TransformerModel` behind `model` (itself, or the one a decoder
    `GenerativeModel` adapts), or None for models that only offer the tensor contract."""
    from ..generative import DecoderGenerativeModel, GenerativeModel
    from ..model_engine import TransformerModel
    if isinstance(model, TransformerModel):
        return model
    if isinstance(model, DecoderGenerativeModel):
        return model.model
    if isinstance(model, GenerativeModel):
        return None
    raise _expected(model)


def generative_model(model):
    """`model` behind the tensor contract (adapting a TransformerModel)."""
    from ..generative import DecoderGenerativeModel, GenerativeModel
    from ..model_engine import TransformerModel
    if isinstance(model, GenerativeModel):
        return model
    if isinstance(model, TransformerModel):
        return DecoderGenerativeModel(model)
    raise _expected(model)


def context_limit(model, default: int | None = None) -> int | None:
    """Most positions one sequence of `model` may hold (its `max_seq_len`: the smaller of
    the `max_seq_len` load option, max_position_embeddings and the KV pool), or `default`
    for tensor-contract models that do not say."""
    inner = pointer_model(model) if not hasattr(model, "_max_seq_len") else model
    limit = getattr(inner, "_max_seq_len", None)
    return default if limit is None else int(limit)


def eos_ids(model) -> list[int]:
    return list(model.metadata().eos_token_ids or ())
