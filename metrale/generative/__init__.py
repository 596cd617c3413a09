"""Layer 5: the tensor contract — `GenerativeModel`, `KVCache`, `SpeechToTextModel`."""
from ..gpu_runtime.arrays import to_backend, to_numpy
from .contract import GenerativeModel, SpeechToTextModel
from .decoder import DecoderGenerativeModel
from .kv_cache import KVCache

__all__ = ["GenerativeModel", "SpeechToTextModel", "DecoderGenerativeModel", "KVCache",
           "to_numpy", "to_backend"]
