"""Layer 4: the pointer API — the original engine's `Model` supertraits as mixins
(ModelLogits, ModelForward, ModelLifecycle, ModelVerify, ModelStreams, ModelAdapters,
ModelSsmState and the probes of probes.py) and `TransformerModel`, which composes them;
`HybridModel` adds the recurrent layers of the hybrid linear-attention families."""
from .forward import BeamReq, MixedBatchResult, MixedForwardResult, ModelForward, PrefillSlice
from .ladder import GRAPH_BATCH_LADDER, padded_batch_n
from .lifecycle import ModelLifecycle
from .logits import ModelLogits
from .adapters import ModelAdapters
from .hybrid import HybridModel
from .probes import ForwardDisclosure, ModelCircuit, ModelDeviceFeed, ModelDraft, ModelEp
from .sequence import SequenceState
from .ssm_state import ModelSsmState
from .streams import ModelStreams
from .transformer import TransformerModel
from .verify import ModelVerify

__all__ = ["ModelLogits", "ModelForward", "ModelLifecycle", "ModelVerify", "ModelStreams",
           "ModelDraft", "ModelAdapters", "ModelSsmState", "ModelEp", "ModelDeviceFeed",
           "ModelCircuit", "ForwardDisclosure", "TransformerModel", "HybridModel", "SequenceState",
           "PrefillSlice", "MixedForwardResult", "MixedBatchResult", "BeamReq",
           "GRAPH_BATCH_LADDER", "padded_batch_n"]
