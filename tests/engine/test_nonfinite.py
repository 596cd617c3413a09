"""Logits holding NaN / Inf stop generation with `NonFiniteLogits` naming the sequence and
position (issue 29 §2), instead of the device argmax's token 0 forever; perplexity refuses
them; `metrale generate` and `metrale ppl` exit 1 with the message. The checkpoints are the
llama_gqa fixture with one embedding row (or the final norm) set to NaN, made here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import metrale
from metrale import NonFiniteLogits
from metrale.engine import Scheduler, generate, perplexity, speculative_generate
from metrale.engine.sampling import SamplingParams
from metrale.formats import DirectorySource
from metrale.gpu_runtime import HostBackend
from tests.formats.st_util import write_checkpoint
from tests.model.common import FIXTURES

ROOT = Path(__file__).resolve().parents[2]
NAN_BF16 = np.uint16(0x7FC0)
PROMPT = [17, 42, 99, 7, 130]


def poisoned(path: Path, tensor: str, row: int | None = None) -> Path:
    """A copy of llama_gqa with `tensor` (its row `row`, or all of it) set to NaN."""
    src = DirectorySource(FIXTURES / "llama_gqa")
    tensors = {n: np.array(src.read_bf16(n)) for n in src.tensor_names()}
    if row is None:
        tensors[tensor][...] = NAN_BF16
    else:
        tensors[tensor][row] = NAN_BF16
    gen = json.loads((FIXTURES / "llama_gqa" / "generation_config.json").read_text())
    return write_checkpoint(path, src.config(), tensors, generation_config=gen)


def load(path, **kw):
    return metrale.load(path, HostBackend(), progress=False, kv_blocks=64, block_size=4, **kw)


@pytest.fixture(scope="module")
def clean():
    return load(FIXTURES / "llama_gqa")


@pytest.fixture(scope="module")
def case(clean, tmp_path_factory):
    """(model whose embedding row of token `bad` is NaN, bad, k): the clean greedy run of
    PROMPT makes `bad` as new token k (and not before), so the poisoned model makes the
    same k + 1 tokens and meets NaN logits at new token k + 1."""
    want = generate(clean, PROMPT, 24, stop_token_ids=[]).tokens
    k = next(i for i, t in enumerate(want) if i >= 2 and t not in PROMPT and t not in want[:i])
    path = poisoned(tmp_path_factory.mktemp("nan") / "m", "model.embed_tokens.weight", want[k])
    return load(path), want, k


def test_generate_stops_at_the_first_nan_logits_naming_the_position(case):
    m, want, k = case
    seen = []
    with pytest.raises(NonFiniteLogits) as e:
        generate(m, PROMPT, 24, stop_token_ids=[], on_token=seen.append)
    assert seen == want[:k + 1]         # every token before the NaN logits was made
    pos = len(PROMPT) + k
    assert f"new token {k + 1} (the logits of sequence position {pos})" in str(e.value)
    assert "NaN/Inf" in str(e.value) and m.num_free_blocks() + m._pool.num_cached() == 64
    # sampling too: a prompt ending in the poisoned token gives NaN logits at once
    with pytest.raises(NonFiniteLogits, match=f"new token 0 \\(the logits of sequence "
                                              f"position {len(PROMPT)}\\)"):
        generate(m, PROMPT + [want[k]], 24, SamplingParams(temperature=0.8, seed=3),
                 stop_token_ids=[])


def test_speculative_stops_where_generate_does(case, clean):
    m, want, k = case
    for draft in (clean, m):
        with pytest.raises(NonFiniteLogits, match=f"new token {k + 1} \\(the logits of "
                                                  f"sequence position {len(PROMPT) + k}\\)"):
            speculative_generate(m, draft, PROMPT, 24, k=3, stop_token_ids=[])


def test_scheduler_fails_the_request_and_serves_the_others(case, clean):
    m, want, k = case
    sched = Scheduler(m, chunk_tokens=8)
    good = [3, 5, 8]
    ok = sched.add_request(good, 6, stop_token_ids=[])
    bad = sched.add_request(PROMPT, 24, stop_token_ids=[])
    errors = []
    while sched.has_work():
        try:
            sched.step()
        except NonFiniteLogits as e:
            errors.append(str(e))
    assert len(errors) == 1 and f"request {bad}, new token {k + 1}" in errors[0]
    r = sched.finished[bad]
    assert r.finish_reason == "error" and r.output == want[:k + 1] and r.error == errors[0]
    assert sched.finished[ok].output == generate(clean, good, 6, stop_token_ids=[]).tokens
    m.reclaim_prefix_blocks(m.num_total_blocks())
    assert m.num_free_blocks() == m.num_total_blocks()


def test_perplexity_refuses_nan_logits_naming_the_position(case, clean):
    m, want, k = case
    text = PROMPT + want[:k + 3]
    assert np.isfinite(perplexity(clean, text))
    # in one forward pass the NaN K/V row reaches the earlier positions too (0 x NaN in the
    # masked P @ V product): a chunk starting at the poisoned
    # token keeps the positions before it finite, so the first NaN row is its own
    pos = len(PROMPT) + k
    with pytest.raises(NonFiniteLogits, match=f"sequence position {pos} "
                                              f"\\(scoring token {pos + 1}\\)"):
        perplexity(m, text, chunk=pos)


def run_cli(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "metrale.cli", *map(str, argv),
                           "--device", "cpu"], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_generate_and_ppl_exit_1_on_nan_weights(tmp_path):
    """The issue's run: weights with NaN printed `0 0 0 0 0` and `perplexity nan`, exit 0."""
    path = poisoned(tmp_path / "m", "model.norm.weight")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (FIXTURES / "tokenizer" / f).exists():
            shutil.copy(FIXTURES / "tokenizer" / f, path / f)
    g = run_cli("generate", path, "--ids", "5,6,7", "--max-new-tokens", "5")
    assert g.returncode == 1, g.stderr
    assert "new token 0 (the logits of sequence position 2)" in g.stderr and "NaN/Inf" in g.stderr
    p = run_cli("ppl", path, "--ids", "5,6,7,8")
    assert p.returncode == 1, p.stderr
    assert "perplexity: the logits of sequence position 0" in p.stderr
    assert "perplexity nan" not in p.stdout


def test_embed_refuses_nan_hidden_states_naming_input_and_position(case, clean):
    m, want, k = case
    from metrale.engine import embed
    ok = [PROMPT, PROMPT + want[:k]]             # before the poisoned token: finite
    assert np.isfinite(embed(m, ok)).all()
    # mean pooling reads every position, and in one forward pass the NaN K/V row reaches
    # the earlier ones too (0 x NaN in the masked P @ V product; see the perplexity test)
    for pooling, pos in (("last", len(PROMPT) + k), ("mean", 0)):
        with pytest.raises(NonFiniteLogits, match=f"embed: input 1: the hidden state of "
                                                  f"sequence position {pos} holds"):
            embed(m, [PROMPT, PROMPT + want[:k + 1]], pooling=pooling)


def test_cli_embed_and_bench_exit_1_on_nan_weights(tmp_path):
    """`embed` printed NaN vectors (and `NaN` in its JSON, which is not JSON) with exit 0;
    `bench` timed the model."""
    path = poisoned(tmp_path / "m", "model.norm.weight")
    e = run_cli("embed", path, "--ids", "5,6,7", "--json")
    assert e.returncode == 1 and e.stdout == "", (e.stdout, e.stderr)
    assert "embed: input 0: the hidden state of sequence position 2 holds" in e.stderr
    b = run_cli("bench", path, "--batch", "1", "--prompt-len", "8", "--gen-len", "2",
                "--json", tmp_path / "b.json")
    assert b.returncode == 1 and not (tmp_path / "b.json").exists(), b.stderr
    assert "bench: the logits of a 8-token prompt's last position" in b.stderr
    assert "NaN/Inf" in b.stderr and "nothing to measure" in b.stderr
