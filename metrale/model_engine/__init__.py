"""Layer 4: the pointer API (ModelLogits, ModelForward, ModelLifecycle, ModelVerify,
ModelStreams) and `TransformerModel`, which composes them."""
from .forward import ModelForward, PrefillChunk
from .lifecycle import ModelLifecycle
from .logits import ModelLogits
from .sequence import SequenceState
from .streams import ModelStreams
from .transformer import TransformerModel
from .verify import ModelVerify

__all__ = ["ModelLogits", "ModelForward", "ModelLifecycle", "ModelVerify", "ModelStreams",
           "TransformerModel", "SequenceState", "PrefillChunk"]
