"""Kernel families: per family one module holding the launcher(s) and the numpy twin(s).

Launchers take `(backend, stream, <pointers and sizes>)`, check what can be checked about
sizes before anything is launched, and call `backend.launch` with `DevicePtr` pointers and
np.int32 / np.float32 scalars, in the order of the `.cu` entry point.

Importing this package imports every family, so every twin is in the device layer's table
(`metrale.gpu_runtime.twins`) before a `HostBackend` can be asked for one.
"""
from . import (activation, argmax, attention, attention_tc, cast, conv1d, dense_attention,
               elementwise, embedding, gemm, gemm_q, gemm_tc, kv_cache, rmsnorm, rope, sampling,
               tensor_parallel, vision)
from . import moe_combine, moe_gemm, moe_gemm_q, moe_router  # mixture-of-experts layers
from . import gemm_fused  # decode GEMMs with rmsnorm / act_mul / the residual add fused
from . import gemm_gguf  # llama.cpp's block formats kept at their bytes
from . import causal_conv1d, gated_delta_rule, mamba2_ssd  # hybrid models' recurrent layers
from . import lora  # the grouped LoRA GEMMs (adapters per row)
from . import gated_norm  # hybrid models' norms and gates
from . import deepseek_router, attention_mla, mla_project  # DeepSeek routing and MLA

__all__ = ["activation", "argmax", "attention", "attention_tc", "cast", "conv1d",
           "dense_attention", "elementwise", "embedding", "gemm", "gemm_q", "gemm_tc", "kv_cache",
           "rmsnorm", "rope", "sampling", "tensor_parallel", "vision", "moe_combine",
           "moe_gemm", "moe_gemm_q", "moe_router", "gemm_fused", "gemm_gguf", "causal_conv1d",
           "gated_delta_rule", "mamba2_ssd", "lora", "gated_norm", "deepseek_router",
           "attention_mla", "mla_project"]
