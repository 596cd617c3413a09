"""Loading fixture checkpoints and reading their golden HF outputs."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import metrale
from metrale.gpu_runtime import HostBackend
from metrale.ops.bf16 import bf16_to_f32

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# mixture-of-experts decoders (make_fixtures.py MOE_DECODERS)
MOE_FIXTURES = ["qwen3_moe", "qwen2_moe", "mixtral"]
DECODER_FIXTURES = ["llama_gqa", "llama_mqa_tied", "mistral", "qwen2", "qwen3"] + MOE_FIXTURES
# issue 40's families (make_family_fixtures.py): the golden suite runs them too; tensor
# parallelism does not take them (tests/tp)
FAMILY_FIXTURES = ["gemma2", "gemma3_text", "gemma3", "phi3", "gpt_oss", "gpt_oss_mxfp4"]
# one tiny checkpoint per honoured config field (make_fixtures.py FIELD_FIXTURES)
FIELD_FIXTURES = ["llama_attention_bias", "llama_mlp_bias", "qwen3_attention_bias",
                  "llama_gelu", "llama_gelu_pytorch_tanh", "mistral_gelu_new", "qwen2_relu",
                  "llama_quick_gelu", "mistral_window", "qwen2_window_max_window_layers",
                  "qwen3_window_layer_types", "llama_dynamic_rope", "llama_tied_stored_head"]
# ... of the mixture-of-experts families (make_fixtures.py MOE_FIELD_FIXTURES)
MOE_FIELD_FIXTURES = ["qwen3_moe_norm_topk_prob", "qwen3_moe_decoder_sparse_step",
                      "qwen3_moe_attention_bias", "qwen3_moe_window",
                      "qwen2_moe_mlp_only_layers", "qwen2_moe_no_qkv_bias",
                      "qwen2_moe_window_max_window_layers", "mixtral_window"]
FIELD_FIXTURES = FIELD_FIXTURES + MOE_FIELD_FIXTURES
# fields that change which tensors a layer has: ignoring one makes the checkpoint fail to
# load (tests/model/test_moe.py), not compute another model
MOE_STRUCTURAL = ["qwen3_moe_decoder_sparse_step", "qwen2_moe_mlp_only_layers",
                  "qwen2_moe_no_qkv_bias"]


def golden(name: str) -> dict:
    with np.load(FIXTURES / name / "golden.npz") as g:
        return {k: g[k] for k in g.files}


def load(name: str, backend=None, **options):
    return metrale.load(FIXTURES / name, backend or HostBackend(), progress=False, **options)


def logits_rows(model, ptr, n: int = 1) -> np.ndarray:
    """[n, vocab] float32 copy of logits rows at ptr."""
    V = model.vocab_size()
    if model.logits_ptr_is_fp32(ptr):
        out = np.empty((n, V), np.float32)
        model.copy_logits_to_host(ptr, out.view(np.uint8).reshape(-1))
        return out
    bits = np.empty((n, V), np.uint16)
    model.copy_logits_to_host(ptr, bits.view(np.uint8).reshape(-1))
    return bf16_to_f32(bits)


def rel_err(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def assert_matches_golden(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The issues' model-level bound: relative max error well under 4% of max |logit|, and
    the same top-1 wherever the golden top-2 margin exceeds 0.05."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    err = rel_err(got, want)
    assert err < 0.03, f"{what}: relative max error {err:.4f}"
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear]), f"{what}: top-1 differs"
