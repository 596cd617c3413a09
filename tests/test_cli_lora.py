"""`metrale generate --lora NAME=DIR ... --adapter NAME` and `metrale info --lora ...`: the
adapter's greedy tokens, the flags' errors (one line, exit 2), the slots info reports and
counts in the memory needed."""
import json

import pytest

import metrale
from metrale.cli import main
from metrale.engine import generate
from metrale.gpu_runtime import HostBackend
from tests.model.common import FIXTURES

BASE = str(FIXTURES / "qwen2")
QV, PAT = str(FIXTURES / "lora" / "qv_r8"), str(FIXTURES / "lora" / "pattern_r4")


def gen(capsys, *extra):
    assert main(["generate", BASE, "--device", "cpu", "--ids", "5,6,7,8", "--max-new-tokens",
                 "6", "--ignore-eos", *extra]) == 0
    out = capsys.readouterr()
    return [int(t) for t in out.out.split()], out.err


def test_generate_with_an_adapter(capsys):
    m = metrale.load(BASE, HostBackend(), progress=False, loras={"qv": QV, "p": PAT})
    for adapter in ("qv", "p", None):
        want = generate(m, [5, 6, 7, 8], 6, stop_token_ids=[], adapter=adapter).tokens
        extra = ["--lora", f"qv={QV}", "--lora", f"p={PAT}"]
        got, err = gen(capsys, *extra, *(["--adapter", adapter] if adapter else []))
        assert got == want, adapter
        assert ("LoRA adapter " + adapter in err) if adapter else "LoRA" not in err
    base, _ = gen(capsys)
    assert base == generate(m, [5, 6, 7, 8], 6, stop_token_ids=[]).tokens


@pytest.mark.parametrize("extra, needle", [
    (["--adapter", "qv"], "--adapter qv: no --lora qv=DIR was given"),
    (["--lora", "qv"], "expected NAME=DIR"),
    (["--lora", "qv=/no/such/dir"], "no such directory"),
    (["--lora", f"qv={QV}", "--lora", f"qv={PAT}"], "'qv' is given twice"),
])
def test_generate_flag_errors(capsys, extra, needle):
    assert main(["generate", BASE, "--device", "cpu", "--ids", "5,6", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_generate_refuses_a_bad_adapter_by_name(capsys):
    assert main(["generate", BASE, "--device", "cpu", "--ids", "5,6", "--lora",
                 f"x={FIXTURES / 'qwen2'}", "--adapter", "x"]) == 1
    assert "no adapter_config.json" in capsys.readouterr().err


def test_info_lists_the_slots_and_counts_them(capsys):
    assert main(["info", BASE, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["lora"] is None
    assert main(["info", BASE, "--json", "--lora", f"qv={QV}", "--lora", f"p={PAT}",
                 "--max-loras", "3"]) == 0
    d = json.loads(capsys.readouterr().out)["lora"]
    assert (d["slots"], d["max_rank"], d["padded_rank"]) == (3, 12, 16)
    assert [a["name"] for a in d["adapters"]] == ["qv", "p"]
    assert d["adapters"][1]["modules"] == ["k_proj", "o_proj", "up_proj", "down_proj"]
    m = metrale.load(BASE, HostBackend(), progress=False, max_loras=3, max_lora_rank=12)
    assert d["slot_bytes"] == m.lora_slots()[0].nbytes and d["bytes"] == m._lora.nbytes
    assert main(["info", BASE, "--json", "--max-loras", "3", "--max-lora-rank", "12"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_needed_bytes"] == \
        plain["memory_needed_bytes"] + d["bytes"]
    assert main(["info", BASE, "--lora", f"qv={QV}"]) == 0
    out = capsys.readouterr().out
    assert "lora slots     1 x rank 8 (held padded to 16)" in out
    assert "lora qv        rank 8, q_proj, v_proj on 2 layer(s), scaling 2.0" in out
    assert main(["info", BASE, "--lora", f"qv={QV}", "--max-lora-rank", "4"]) == 1
    assert "rank 8, above the slots' max_lora_rank=4" in capsys.readouterr().err
