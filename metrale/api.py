"""`metrale.load` / `metrale.load_generative`: the right model for a checkpoint.

The dispatch on the checkpoint's architecture lives here and only here; the model classes
and the tensor-contract adapters below take a built source / model and never call back.
"""
from __future__ import annotations

from .errors import InvalidArgument, Unsupported
from .gpu_runtime import backend_for


def load(path_or_source, device="auto", *, kv_blocks=None, block_size=16, max_batch=64,
         fp32_logits=False, tensor_parallel_size=1, **options):
    """Load a checkpoint directory, `.safetensors` or `.gguf` file or `ModelSource`.

    Returns a `TransformerModel` (llama, mistral, qwen2, qwen3, the MoE families), a
    `HybridModel` (qwen3_next, qwen3_5: linear-attention layers), a `WhisperModel`
    (whisper) or a multimodal `LlavaModel` (llava). `device`: "auto" | "cpu" | "cuda[:N]"
    or a backend instance.

    A llama.cpp `.gguf` file's weights of a block type (Q4_0 ... Q8_0, Q2_K ... Q6_K,
    IQ4_NL, IQ4_XS) stay at their stored bytes on the device and are dequantized inside
    the GEMMs and the embedding lookup, to the bits of dequantizing them at load:
    `model.weight_bytes()` is about the file's tensor bytes. `gguf_dequantize=True`
    (decoder models) dequantizes them to BF16 at load instead: the same logits, 1.9-6x the
    bytes (a safetensors checkpoint ignores it). A tensor-parallel load dequantizes at
    load either way, for now.

    LoRA adapters (decoder models; README "LoRA adapters"): `max_loras=N` adapter slots of
    rank up to `max_lora_rank=R` on the device, `loras={name: adapter_dir}` PEFT adapters
    loaded into them at start; then `alloc_sequence(adapter=name)` and the original's
    `swap_lora_from_disk` / `promote_lora_from_disk` / `set_active_lora`.

    `tensor_parallel_size=N > 1`: this process is one of N ranks started by a launcher
    (mpiexec, torchrun, srun), each calling `load` alike; returns this rank's
    `TensorParallelModel` (decoder-only architectures). "cuda" / "auto" then mean the GPU of
    the rank's local rank. Options of the group: `tp_timeout_s` (default 300: how long a rank
    waits for the others before TensorParallelError) and `tp_rendezvous` ("host:port" where
    NCCL's id is handed out when no MPI launcher started the ranks). A mixture of experts
    is split inside every expert; `expert_parallel=True` partitions whole experts over the
    ranks instead, tokens dispatched by all-to-all (model_engine/tp/expert_parallel.py).
    """
    if not (type(tensor_parallel_size) is int and tensor_parallel_size == 1):
        # checks the size itself; opens the checkpoint once the ranks are in touch
        from .model_engine.tp.model import load_rank
        return load_rank(device, path_or_source, tensor_parallel_size=tensor_parallel_size,
                         kv_blocks=kv_blocks, block_size=block_size, max_batch=max_batch,
                         fp32_logits=fp32_logits, **options)
    if options.pop("expert_parallel", False):
        raise InvalidArgument("expert_parallel=True partitions the experts over the ranks of "
                              "a tensor-parallel load: pass tensor_parallel_size=N > 1")
    from .formats import open_source
    source = open_source(path_or_source)
    meta = source.metadata()
    be = backend_for(device)
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
    if meta.hybrid is not None:   # linear-attention / SSM layers (issue 39)
        from .model_engine import HybridModel
        return HybridModel(be, source, kv_blocks=kv_blocks, block_size=block_size,
                           max_batch=max_batch, fp32_logits=fp32_logits, **options)
    from .model_engine import TransformerModel
    return TransformerModel(be, source, kv_blocks=kv_blocks, block_size=block_size,
                            max_batch=max_batch, fp32_logits=fp32_logits, **options)


def load_generative(path_or_source, device="auto", **load_options):
    """Load a checkpoint behind the tensor contract: a `GenerativeModel` adapter over
    `TransformerModel` for decoder-only checkpoints, `LlavaGenerativeModel` (with
    `embed_multimodal`) for llava, the `SpeechToTextModel` for whisper."""
    if load_options.get("tensor_parallel_size", 1) != 1:
        raise Unsupported("load_generative: tensor parallelism is served through the pointer "
                          "API (metrale.load(..., tensor_parallel_size=N)); the tensor "
                          "contract runs on one device")
    model = load(path_or_source, device, **load_options)
    from .generative import DecoderGenerativeModel, GenerativeModel, SpeechToTextModel
    if isinstance(model, (GenerativeModel, SpeechToTextModel)):
        return model
    if model.metadata().architecture == "llava":
        from .vision.generative import LlavaGenerativeModel
        return LlavaGenerativeModel(model)
    return DecoderGenerativeModel(model)
