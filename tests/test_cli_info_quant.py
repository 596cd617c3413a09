"""`metrale info` and the roofline on quantized checkpoints: the format, the real weight
bytes (packed data + scales + zeros as uploaded) and the bytes a decode step reads."""
import json

from metrale.bench import roofline
from metrale.cli import main
from metrale.formats import MemorySource
from metrale.gpu_runtime import HostBackend
from metrale.model_engine import memory_plan
from tests.model.common import FIXTURES, load


def info_json(capsys, *args):
    assert main(["info", "--json", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_reports_the_format_and_the_real_bytes(capsys):
    q = info_json(capsys, "preset:qwen2.5-0.5b-gptq")
    bf = info_json(capsys, "preset:qwen2.5-0.5b")
    assert q["quantization"] == "gptq" and bf["quantization"] is None
    assert q["parameters"] == bf["parameters"]
    assert "GPTQ 4-bit, groups of 128" in q["math"]["quantization"]
    # a BF16 tied head (vocab x hidden) and embeddings keep the ratio near 2.2, not 4
    assert 2.0 < bf["weight_bytes"] / q["weight_bytes"] < 2.4
    assert q["decode_step_bytes"] == roofline.decode_step_bytes(
        MemorySource.preset("qwen2.5-0.5b-gptq").metadata(), [4096])
    fp8 = info_json(capsys, "preset:qwen2.5-0.5b-fp8")
    assert 1.4 < bf["weight_bytes"] / fp8["weight_bytes"] < 1.8
    out = info_json(capsys, FIXTURES / "q_awq")["math"]["quantization"]
    assert "AWQ 4-bit GEMM" in out and "left BF16: down_proj, lm_head" in out


def test_weight_bytes_are_what_the_model_allocates():
    for name in ("q_fp8_block", "q_gptq_v2_actorder", "q_awq", "q_ct_fp8_channel"):
        be = HostBackend()
        before = be.live_bytes()
        m = load(name, be)
        w = memory_plan.weight_bytes(m._meta)
        assert m._weights.nbytes == w
        # every byte the weights own (HostBackend records each allocation's size)
        assert sum(be._sizes[int(p)] for p in m._weights._owned) == w, name
        assert be.live_bytes() > before
