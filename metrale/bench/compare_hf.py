"""Hugging Face transformers on the same weights as metrale: model building and timing.

torch and transformers are optional: they are imported inside `require_torch` only, never at
module import, and no other metrale module imports them.

`build_hf_model` makes the HF model from the checkpoint's own config dict and overwrites
every parameter with the BF16 bits metrale loads (`source.read_bf16` per HF tensor name);
the float32 model holds those bits widened exactly. `HFRunner` times one repetition the way
`metrale bench` times metrale (prefill tok/s, then greedy decode steps at batch B, each step
ending with the argmax on the host); `metrale_last_logits` / `logits_error` give the logits
check that proves both sides run the same model.
"""
from __future__ import annotations

import inspect
import time

import numpy as np

from ..errors import Unsupported
from .hf_moe_state import hf_state_renames

DTYPES = ("float32", "bfloat16")
PREFILL_MODE = "one batched forward of the B prompts, logits_to_keep=1"
DECODE_MODE = ("manual greedy loop: forward of one token per row with past_key_values "
               "(DynamicCache, `cache` in newer transformers) and logits_to_keep=1, argmax copied to the host every step")
ATTN_IMPLEMENTATION = "sdpa"
FALLBACK_ATTN_IMPLEMENTATION = "eager"  # for models whose HF class refuses sdpa (gpt-oss)


def require_torch():
    """(torch, transformers), or Unsupported naming what to install."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise Unsupported(f"--compare-hf needs torch and transformers ({e}); install them "
                          "with: pip install torch transformers") from None
    return torch, transformers


def torch_facts(torch, transformers) -> dict:
    """Versions and thread count of the torch that runs the comparison."""
    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__),
            "torch_threads": int(torch.get_num_threads())}


def _from_config_impl(transformers, config, dtype, impl):
    cls = transformers.AutoModelForCausalLM
    try:  # transformers >= 4.56 names it dtype; older ones torch_dtype
        return cls.from_config(config, dtype=dtype, attn_implementation=impl)
    except TypeError:
        return cls.from_config(config, torch_dtype=dtype, attn_implementation=impl)


def _from_config(transformers, config, dtype):
    """The model with sdpa attention, or eager where transformers refuses sdpa for the
    class (ValueError); the implementation used is `model.config._attn_implementation`."""
    try:
        return _from_config_impl(transformers, config, dtype, ATTN_IMPLEMENTATION)
    except ValueError:
        return _from_config_impl(transformers, config, dtype, FALLBACK_ATTN_IMPLEMENTATION)


def build_hf_model(torch, transformers, source, device: str, dtype_name: str):
    """The HF causal LM of `source`'s config.json, in `dtype_name` on torch `device`, with
    every parameter copied from `source.read_bf16` (the bits metrale loads).

    Returns (model, names of HF state entries not read from the source: they must be
    empty or buffers HF recomputes; lm_head under tied embeddings is left out)."""
    cfg = {k: v for k, v in source.config().items()
           if k not in ("architectures", "torch_dtype", "dtype", "transformers_version")}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    dtype = getattr(torch, dtype_name)
    with torch.device(device):  # random init here is wasted but fast; all of it is replaced
        model = _from_config(transformers, config, dtype)
    model.eval()
    state = model.state_dict()
    # MoE experts: one tensor per expert in the checkpoint, stacked in transformers 5
    moe_state, moe_used = hf_state_renames(source)
    reads = {n: (lambda n=n: source.read_bf16(n)) for n in source.tensor_names()
             if n not in moe_used}
    reads.update(moe_state)
    names = list(reads)
    missing = [n for n in names if n not in state]
    if missing:
        raise Unsupported(f"{source.description}: transformers' {type(model).__name__} has no "
                          f"parameter for {missing[:5]} ({len(missing)} in all)")
    with torch.no_grad():
        for name in names:
            bits = np.ascontiguousarray(reads[name]())
            t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            dst = state[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise Unsupported(f"{source.description}: {name} has shape {tuple(t.shape)} "
                                  f"but transformers expects {tuple(dst.shape)}")
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    have = set(names)
    untouched = [n for n in state if n not in have and not n.endswith("lm_head.weight")]
    return model, untouched


class HFRunner:
    """Times HF repetitions of one model (one dtype): `rep(prompts, steps)` ->
    {"prefill_s", "decode_s", "decode_steps"}; `last_logits(prompt)` -> float32 [vocab]."""

    def __init__(self, torch, model, dtype_name: str) -> None:
        self.torch, self.model, self.dtype_name = torch, model, dtype_name
        self.device = next(model.parameters()).device
        # transformers >= 5.2x renamed past_key_values to cache (the old name warns)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids, cache):
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1,
                         **{self._cache_arg: cache})
        # logits [B, 1, V]; the argmax goes to the host like metrale's argmax_batch
        return out.logits[:, -1, :].argmax(-1).cpu(), getattr(out, self._cache_arg)

    def rep(self, prompts: list[list[int]], steps: int) -> dict:
        """Prefill the B prompts ([B][P] token ids, one batched forward), then `steps`
        greedy decode steps of all B rows; wall seconds of each phase."""
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            nxt, cache = self._forward(ids, None)
            t_pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt, cache = self._forward(nxt.to(self.device)[:, None], cache)
            t_dec = time.perf_counter() - t0
        return {"prefill_s": t_pre, "decode_s": t_dec, "decode_steps": steps}

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """Float32 logits [vocab] of the last position of one prompt."""
        torch = self.torch
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return out.logits[0, -1].float().cpu().numpy()


def metrale_last_logits(model, prompt: list[int]) -> np.ndarray:
    """Float32 logits [vocab] of the last position after metrale prefills `prompt`."""
    seq = model.alloc_sequence()
    try:
        ptr = model.prefill(prompt, seq, model.default_stream())
        fp32 = model.logits_ptr_is_fp32(ptr)
        row = np.empty(model.vocab_size(), np.float32 if fp32 else np.uint16)
        model.copy_logits_to_host(ptr, row)
    finally:
        model.free_sequence(seq)
    if row.dtype == np.uint16:
        row = (row.astype(np.uint32) << 16).view(np.float32)
    return row


def logits_error(ours: np.ndarray, ref: np.ndarray) -> dict:
    """max |ours - ref| / max |ref| and whether the argmaxes agree."""
    err = float(np.max(np.abs(ours - ref)) / max(float(np.max(np.abs(ref))), 1e-12))
    return {"rel_max_err": err, "argmax_metrale": int(np.argmax(ours)),
            "argmax_hf": int(np.argmax(ref)),
            "argmax_agree": int(np.argmax(ours)) == int(np.argmax(ref))}


def load_runners(source, device: str, dtypes) -> tuple[dict, dict]:
    """({dtype: HFRunner}, facts: versions, threads, load seconds, untouched state names)
    for each dtype name in `dtypes` (a subset of DTYPES)."""
    torch, transformers = require_torch()
    facts = torch_facts(torch, transformers)
    facts.update({"device": device, "load_s": {}, "params_not_from_source": {}})
    runners = {}
    for name in dtypes:
        t0 = time.perf_counter()
        model, untouched = build_hf_model(torch, transformers, source, device, name)
        facts["load_s"][name] = time.perf_counter() - t0
        facts["params_not_from_source"][name] = untouched
        facts["attn_implementation"] = str(getattr(model.config, "_attn_implementation",
                                                   ATTN_IMPLEMENTATION))
        runners[name] = HFRunner(torch, model, name)
    return runners, facts
