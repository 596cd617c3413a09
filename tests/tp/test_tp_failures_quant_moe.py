"""The rank-failure cases of test_tp_failures.py on a quantized mixture-of-experts
checkpoint split over two ranks (q_moe_gptq_actorder: experts cut packed, every rank's
combine summed in rank order): a truncated file on one rank ends both ranks at once with
the failing rank's error, and SIGINT to one rank mid-decode aborts the job with status 130,
within the time limits of the dense cases."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.tp.launch import ROOT
from tests.tp.test_tp_failures import check_aborted, launch, raised

FIXTURE = ROOT / "tests" / "fixtures" / "q_moe_gptq_actorder"


@pytest.fixture(scope="module")
def quant_moe(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tp_failures_quant_moe")
    shutil.copytree(FIXTURE, d / "good")
    shutil.copytree(FIXTURE, d / "truncated")
    weights = d / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    return d


def test_a_truncated_quantized_moe_on_one_rank_ends_every_rank(quant_moe, tmp_path):
    status, out, err, wall = launch("truncated", quant_moe, tmp_path)
    assert status != 0
    what = r"model\.safetensors: tensor '.*': data_offsets .* truncated file\?"
    assert re.match(rf"FormatError after [\d.]+ s: \S*truncated/{what}", raised(out, 1)), out
    assert re.match(rf"FormatError after [\d.]+ s: tensor parallel: rank 1 of 2 failed: "
                    rf"\S*truncated/{what}", raised(out, 0)), out
    assert "LOADED" not in out
    assert wall < 20, wall


@pytest.mark.parametrize("rank", [0, 1])
def test_sigint_to_one_rank_aborts_a_quantized_moe_job(quant_moe, tmp_path, rank):
    check_aborted(*launch(f"interrupt{rank}", quant_moe, tmp_path), ranks=[[str(rank)]])
