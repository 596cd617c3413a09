"""What the engine functions accept: a `TransformerModel` or a `GenerativeModel`."""
from __future__ import annotations

from ..errors import InvalidArgument


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
    raise InvalidArgument(f"expected a TransformerModel (metrale.load) or a GenerativeModel "
                          f"(metrale.load_generative), got {type(model).__name__}")


def generative_model(model):
    """`model` behind the tensor contract (adapting a TransformerModel)."""
    from ..generative import DecoderGenerativeModel, GenerativeModel
    from ..model_engine import TransformerModel
    if isinstance(model, GenerativeModel):
        return model
    if isinstance(model, TransformerModel):
        return DecoderGenerativeModel(model)
    raise InvalidArgument(f"expected a TransformerModel (metrale.load) or a GenerativeModel "
                          f"(metrale.load_generative), got {type(model).__name__}")


def eos_ids(model) -> list[int]:
    return list(model.metadata().eos_token_ids or ())
