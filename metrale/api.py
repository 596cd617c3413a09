"""`metrale.load` / `metrale.load_generative`: the right model for a checkpoint."""
from __future__ import annotations

from .errors import Unsupported
from .gpu_runtime import backend as pick_backend


def _backend_of(device):
    # A backend instance may be passed instead of a device string (tests share one to
    # account for every byte; two models can share a device's backend).
    if hasattr(device, "launch") and hasattr(device, "alloc"):
        return device
    return pick_backend(device)


def load(path_or_source, device="auto", *, kv_blocks=None, block_size=16, max_batch=64,
         fp32_logits=False, **options):
    """Load a checkpoint directory, `.safetensors` file or `ModelSource`.

    Returns a `TransformerModel` (llama, mistral, qwen2, qwen3), a `WhisperModel`
    (whisper) or a multimodal `LlavaModel` (llava). `device`: "auto" | "cpu" | "cuda[:N]"
    or a backend instance.
    """
    from .formats import open_source
    source = open_source(path_or_source)
    meta = source.metadata()
    be = _backend_of(device)
    if meta.architecture == "whisper":
        try:
            from .whisper import WhisperModel
        except ImportError as e:
            raise Unsupported(f"{source.description}: whisper support is not available: {e}")
        return WhisperModel(be, source, **options)
    if meta.architecture == "llava":
        try:
            from .vision.llava import LlavaModel
        except ImportError as e:
            raise Unsupported(f"{source.description}: llava support is not available: {e}")
        return LlavaModel(be, source, kv_blocks=kv_blocks, block_size=block_size,
                          max_batch=max_batch, fp32_logits=fp32_logits, **options)
    from .model_engine import TransformerModel
    return TransformerModel(be, source, kv_blocks=kv_blocks, block_size=block_size,
                            max_batch=max_batch, fp32_logits=fp32_logits, **options)


def load_generative(path_or_source, device="auto", **load_options):
    """Load a checkpoint behind the tensor contract: a `GenerativeModel` adapter over
    `TransformerModel` for decoder-only checkpoints, the multimodal model for llava, the
    `SpeechToTextModel` for whisper."""
    model = load(path_or_source, device, **load_options)
    from .generative import DecoderGenerativeModel, GenerativeModel, SpeechToTextModel
    if isinstance(model, (GenerativeModel, SpeechToTextModel)):
        return model
    return model.generative() if hasattr(model, "generative") else DecoderGenerativeModel(model)
