"""Nemotron-H (Mamba2 + attention + relu2 MLP, nemotron_h fixture) beyond the goldens of
test_hybrid_golden.py: its config fields, the SSM-state contract on Mamba2 states, prefix
reuse at its checkpoint interval (chunk 32), speculative == greedy and `metrale info`."""
import json

import numpy as np
import pytest

from metrale import FormatError, Unsupported
from metrale.cli import main
from metrale.engine import generate, speculative_generate
from metrale.formats import ModelMetadata
from tests.model.common import FIXTURES, golden, load
from tests.model.test_hybrid_state import bits, state_of

NAME = "nemotron_h"
IDS = golden(NAME)["input_ids"][0].tolist()


def cfg():
    return json.loads((FIXTURES / NAME / "config.json").read_text())


def test_config_is_read_as_transformers_reads_it():
    c = cfg()
    assert "hybrid_override_pattern" in c and "layers_block_type" not in c
    m = ModelMetadata.from_config(c, source="config.json")
    hy, mb = m.hybrid, m.hybrid.mamba
    assert hy.layer_types == ("mamba", "full_attention", "mlp", "mamba", "mlp", "mamba")
    assert (mb.num_heads, mb.head_dim, mb.n_groups, mb.d_state, mb.chunk_size) == \
        (4, 32, 2, 32, 32) and mb.conv_bias and (mb.dt_min, mb.dt_max) == (0.0, float("inf"))
    assert hy.rotary_dim == 0 and hy.chunk == 32
    old = dict(c, mamba_chunk_size=64, mamba_d_conv=3)   # the older names win, as in HF
    mb = ModelMetadata.from_config(old, source="config.json").hybrid.mamba
    assert (mb.chunk_size, mb.conv_kernel) == (64, 3)


@pytest.mark.parametrize("edit, error, match", [
    (dict(hybrid_override_pattern="M*E-M-"), Unsupported, "'moe' layers"),
    (dict(mlp_hidden_act="silu"), Unsupported, "mlp_hidden_act='silu'"),
    (dict(ssm_state_size=48), Unsupported, "ssm_state_size 48"),
    (dict(use_bias=True), Unsupported, "use_bias"),
    (dict(mamba_hidden_act="gelu"), Unsupported, "mamba_hidden_act"),
    (dict(time_step_limit=[0.1, 0.01]), FormatError, "time_step_limit"),
    (dict(mamba_num_heads=3), FormatError, "multiple of n_groups"),
])
def test_refusals_by_name(edit, error, match):
    with pytest.raises(error, match=match):
        ModelMetadata.from_config({**cfg(), **edit}, source="config.json")


def test_verify_rollback_and_prefix_reuse_on_mamba2_states():
    m = load(NAME, max_batch=4, ssm_prefix_states=2)
    assert m.ssm_checkpoint_interval() == 32
    seq, ref = m.alloc_sequence(), m.alloc_sequence()
    m.prefill(IDS[:40], seq, 0)
    m.prefill(IDS[:40], ref, 0)
    m.decode_verify(IDS[40:45], seq, 0)
    m.rollback(seq, 2)
    for t in IDS[40:43]:
        m.decode(t, ref, 0)
    assert state_of(m, seq) == state_of(m, ref)
    first = m.alloc_sequence()
    want = bits(m, m.prefill(IDS[:90], first, 0))     # keeps the state at 64
    m.free_sequence(first)
    again = m.alloc_sequence()
    assert np.array_equal(bits(m, m.prefill(IDS[:90], again, 0)), want)
    other = m.alloc_sequence()
    assert m.reuse_prefix(other, IDS[:100]) == 64


def test_speculative_equals_greedy():
    target = load(NAME)
    want = generate(target, IDS[:50], 16, stop_token_ids=[]).tokens
    for draft in (NAME, "qwen3_5_text"):
        r = speculative_generate(target, load(draft), IDS[:50], 16, k=3, stop_token_ids=[])
        assert r.tokens == want, draft


def test_info(capsys):
    assert main(["info", str(FIXTURES / NAME), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recurrent"]["kind"] == "Mamba2"
    assert d["recurrent"]["state_bytes_per_sequence"] == load(NAME).state_bytes_per_sequence()
    assert d["kv_bytes_per_token"] == 1 * 2 * 2 * 16 * 2   # the one attention layer
