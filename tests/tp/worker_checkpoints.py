"""Scenarios of tests/tp/worker.py on other checkpoints than the fixtures as they are:
weights holding NaN in one rank's slice only (NonFiniteLogits raised on every rank), and the
GGUF fixtures (dequantized at load, then split like any BF16 checkpoint).

Each takes the worker's `Run` (run.rank, run.out, run.load, run.bits, run.arrays,
run.facts)."""
from __future__ import annotations

import json

import numpy as np

import metrale
from metrale.engine import Scheduler, generate, speculative_generate
from metrale.engine.sampling import SamplingParams
from metrale.formats import DirectorySource
from tests.formats.st_util import write_checkpoint
from tests.model.common import FIXTURES

NAN_BF16 = np.uint16(0x7FC0)
NAN_PROMPT = [17, 42, 99, 7, 130]
NAN_NEW = 24
GGUF_FIXTURES = FIXTURES / "gguf"
GGUF_MODELS = ("llama", "qwen2", "qwen3")
GGUF_PREFIX, GGUF_END = 16, 24   # prefill 16 ids, decode the golden ids 16..23


def poisoned_copy(run, tag: str, tensor: str, row: int):
    """This rank's own copy of llama_gqa with row `row` of `tensor` set to NaN (each rank
    writes its own: the load agreement compares contents, not paths)."""
    src = DirectorySource(FIXTURES / "llama_gqa")
    tensors = {n: np.array(src.read_bf16(n)) for n in src.tensor_names()}
    tensors[tensor][row] = NAN_BF16
    gen = json.loads((FIXTURES / "llama_gqa" / "generation_config.json").read_text())
    return write_checkpoint(run.out / f"{tag}_rank{run.rank}", src.config(), tensors,
                            generation_config=gen)


def _caught(fn) -> list:
    """[class name, message] of the MetraleError `fn()` raised, or None."""
    try:
        fn()
    except metrale.MetraleError as e:
        return [type(e).__name__, str(e)]
    return None


def nonfinite(run) -> None:
    """NaN only in the last rank's slice: the embedding row of a token the clean greedy run
    makes (it reaches every rank through the embedding's sum) and an lm_head row (it reaches
    every rank through the logits gather). Every rank must raise the same NonFiniteLogits
    where one device does: generate (greedy and sampled), speculative, and the Scheduler,
    which fails that request only."""
    clean = run.load("llama_gqa", kv_blocks=64, block_size=4)
    want = generate(clean, NAN_PROMPT, NAN_NEW, stop_token_ids=[]).tokens
    plan = clean._shard_plan
    last = plan.size - 1
    first_of_last = last * plan.vocab_shard   # the last rank's vocabulary rows start here
    k = next(i for i, t in enumerate(want) if i >= 2 and t >= first_of_last
             and t not in NAN_PROMPT and t not in want[:i])
    bad = want[k]
    facts = {"clean": want, "k": k, "bad": bad}
    emb = run.load(poisoned_copy(run, "nan_embed", "model.embed_tokens.weight", bad),
                   kv_blocks=64, block_size=4)
    head = run.load(poisoned_copy(run, "nan_head", "lm_head.weight", bad),
                    kv_blocks=64, block_size=4)
    # which rank holds the NaN row: only the last
    facts["holds_nan"] = plan.vocab_start <= bad < plan.vocab_start + plan.vocab_rows
    seen: list[int] = []
    facts["embed_greedy"] = _caught(lambda: generate(emb, NAN_PROMPT, NAN_NEW,
                                                     stop_token_ids=[], on_token=seen.append))
    facts["embed_seen"] = list(seen)
    facts["embed_sampled"] = _caught(lambda: generate(
        emb, NAN_PROMPT + [bad], NAN_NEW, SamplingParams(temperature=0.8, seed=3),
        stop_token_ids=[]))
    facts["embed_spec"] = _caught(lambda: speculative_generate(emb, clean, NAN_PROMPT,
                                                               NAN_NEW, k=3, stop_token_ids=[]))
    facts["head_greedy"] = _caught(lambda: generate(head, NAN_PROMPT, NAN_NEW,
                                                    stop_token_ids=[]))
    # the Scheduler: the poisoned request fails, the other is served
    sched = Scheduler(emb, chunk_tokens=8)
    good = [3, 5, 8]
    ok = sched.add_request(good, 6, stop_token_ids=[])
    bad_id = sched.add_request(NAN_PROMPT, NAN_NEW, stop_token_ids=[])
    errors = []
    while sched.has_work():
        try:
            sched.step()
        except metrale.NonFiniteLogits as e:
            errors.append(str(e))
    r = sched.finished[bad_id]
    facts["sched"] = {"errors": errors, "reason": r.finish_reason, "output": r.output,
                      "good": sched.finished[ok].output,
                      "good_clean": generate(clean, good, 6, stop_token_ids=[]).tokens}
    for m in (emb, head):
        m.reclaim_prefix_blocks(m.num_total_blocks())
    facts["blocks_back"] = [m.num_free_blocks() == m.num_total_blocks() for m in (emb, head)]
    run.facts["nonfinite"] = facts
    for m in (emb, head, clean):
        m.teardown()


def gguf(run) -> None:
    """The GGUF fixtures (llama with Q4_K..F16, qwen2 with Q6_K and biases, qwen3 with q/k
    norms) at TP: prefill rows and teacher-forced decode rows."""
    for name in GGUF_MODELS:
        with np.load(GGUF_FIXTURES / f"{name}.npz") as g:
            ids = g["input_ids"][0].tolist()
        m = metrale.load(GGUF_FIXTURES / f"{name}.gguf", run.backend(),
                         tensor_parallel_size=run.size, progress=False)
        s = m.default_stream()
        seq = m.alloc_sequence()
        rows = [run.bits(m, m.prefill(ids[:GGUF_PREFIX], seq, s))]
        rows += [run.bits(m, m.decode(t, seq, s)) for t in ids[GGUF_PREFIX:GGUF_END]]
        run.arrays[f"gguf/{name}"] = np.concatenate(rows)
        run.facts.setdefault("gguf_weight_bytes", {})[name] = m.weight_bytes()
        m.teardown()
