"""LoRA adapters at TP=2 over MPI on the CPU (tp/lora_shard.py): each rank holds its slices
(A like the projection's input, B like its output; o and down gather the ranks' partial
x A^T and add them in rank order). Checked: every rank gets the same rows; each adapter's rows
match HF + PEFT and TP=1 within the BF16 tolerance; a mixed batch is bit-equal to each
sequence alone; the base rows are the plain TP=2 model's."""
import numpy as np
import pytest

import metrale
from metrale.gpu_runtime import HostBackend
from metrale.ops.bf16 import bf16_to_f32
from tests.model.common import FIXTURES, assert_matches_golden, golden, rel_err
from tests.model.lora_util import adapter_dirs, lora_golden, run_prompt
from tests.tp.launch import Results, run_worker
from tests.tp.worker_lora import NAMES, PREFIX


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2_lora")
    proc = run_worker(out, "cpu", "lora,golden")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return Results(out, 2, proc)


def test_adapters_at_tp2(tp2):
    tp2.check_scenario("lora")
    ids = golden("qwen2")["input_ids"][0].tolist()
    one = metrale.load(FIXTURES / "qwen2", HostBackend(), progress=False,
                       loras=adapter_dirs(NAMES))
    for name in NAMES:
        got = bf16_to_f32(tp2.same_on_every_rank(f"lora/{name}"))
        assert_matches_golden(got, lora_golden(name)["logits"][PREFIX - 1:], f"{name} TP=2")
        tp1 = run_prompt(one, ids, PREFIX, adapter=name)
        assert rel_err(got, tp1) < 0.02, f"{name}: TP=2 vs TP=1"
    # the base rows of the LoRA model are the plain TP=2 model's, bit for bit
    assert np.array_equal(tp2.same_on_every_rank("lora/None"),
                          tp2.same_on_every_rank("golden/qwen2"))
    assert np.array_equal(tp2.same_on_every_rank("lora/batch"),
                          tp2.same_on_every_rank("lora/solo"))
    for f in tp2.facts:
        assert f["lora_slots"] == [[NAMES[0], 16, 0], [NAMES[1], 12, 0]]
    assert tp2.facts[0]["lora_weight_bytes"] == tp2.facts[1]["lora_weight_bytes"]
