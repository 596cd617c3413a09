"""Tensor-parallel jobs that fail or are interrupted end at once, every rank, with one clear
message: `mpiexec -n 2` launches of tests/tp/job_failures.py on the CPU, one case each.

  - a rank that fails before the communicator exists (a bad config.json or a truncated
    safetensors file seen by one rank) no longer leaves the other waiting in MPI's
    initialisation: the failing rank raises its own FormatError, the other the same class
    naming the failing rank and its message, both within moments (the timeout is 30 s);
  - a rank that never reaches `load` ends the other's wait after its timeout;
  - a rank whose step fails after the agreement (an expert-parallel all-to-all that
    raises) announces it: the other raises TensorParallelError naming it, at once;
  - SIGINT to one rank (expert parallel too), to the whole process group (Ctrl-C: mpiexec forwards it), or a
    KeyboardInterrupt in the `metrale` command before the group exists, aborts the whole
    job at once: status 130, one "metrale: rank R of 2 interrupted; aborting the
    tensor-parallel job" line per interrupted rank, no traceback, no MPI noise.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tp.launch import ROOT, require_mpi

FIXTURE = ROOT / "tests" / "fixtures" / "llama_gqa"
INTERRUPTED = re.compile(r"^metrale: rank ([01]) of 2 interrupted; aborting the "
                         r"tensor-parallel job$", re.M)
# what an aborted job must not print: tracebacks, crashes, MPICH's assertion and abort lines,
# hydra's report of a killed rank
NOISE = re.compile(r"Traceback|Segmentation|assert|BAD TERMINATION|Abort\(|signal 9", re.I)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tp_failures")
    shutil.copytree(FIXTURE, d / "good")
    shutil.copytree(FIXTURE, d / "bad_config")
    (d / "bad_config" / "config.json").write_text("{ not json")
    shutil.copytree(FIXTURE, d / "truncated")
    weights = d / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    shutil.copytree(ROOT / "tests" / "fixtures" / "mixtral", d / "moe")
    shutil.copytree(ROOT / "tests" / "fixtures" / "mixtral", d / "moe_bad_config")
    (d / "moe_bad_config" / "config.json").write_text("{ not json")
    return d


def launch(case: str, d: Path, out: Path, *, timeout: float = 60,
           interrupt_group: bool = False):
    """`mpiexec -n 2 python -m tests.tp.job_failures case d out`; (status, what the ranks
    wrote to out/ then mpiexec's stdout, its stderr, wall seconds). `interrupt_group`:
    mpiexec starts in a session of its own, and once both ranks decode the whole group gets
    SIGINT, as Ctrl-C in a terminal sends it."""
    exe = require_mpi()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out.mkdir(parents=True, exist_ok=True)

    def said() -> str:
        return "".join(f.read_text() for f in sorted(out.glob("rank*.txt")))
    t0 = time.monotonic()
    p = subprocess.Popen([exe, "-n", "2", sys.executable, "-m", "tests.tp.job_failures", case,
                          str(d), str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        if interrupt_group:
            while said().count("DECODING") < 2 and time.monotonic() - t0 < timeout:
                time.sleep(0.02)
            os.killpg(p.pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=max(timeout - (time.monotonic() - t0), 1))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"{case}: still running after {timeout} s\n{said()}{stdout.decode()}\n"
                    f"{stderr.decode()}")
    return p.returncode, said() + stdout.decode(), stderr.decode(), time.monotonic() - t0


def raised(out: str, rank: int) -> str:
    m = re.search(rf"^RANK {rank} RAISED (.*)$", out, re.M)
    assert m, f"rank {rank} raised nothing:\n{out}"
    return m.group(1)


@pytest.mark.parametrize("case,what", [
    ("bad_config", r"config\.json: not valid JSON"),
    ("truncated", r"model\.safetensors: tensor '.*': data_offsets .* truncated file\?")])
def test_a_rank_that_fails_before_the_communicator_ends_every_rank(checkpoints, tmp_path, case,
                                                                   what):
    status, out, err, wall = launch(case, checkpoints, tmp_path)
    assert status != 0
    failing, other = raised(out, 1), raised(out, 0)
    assert re.match(rf"FormatError after [\d.]+ s: \S*{case}/{what}", failing), failing
    assert re.match(rf"FormatError after [\d.]+ s: tensor parallel: rank 1 of 2 failed: "
                    rf"\S*{case}/{what}", other), other
    assert "LOADED" not in out
    assert wall < 20, wall   # the error, not the ranks' 30 s timeout


def test_metrale_command_with_a_bad_checkpoint_on_one_rank(checkpoints, tmp_path):
    """`metrale bench --tensor-parallel 2` opens the checkpoint before the group exists: the
    failing rank hands its error to the other (which waited in MPI's initialisation for the
    300 s default timeout), both exit 1 with it at once."""
    status, out, err, wall = launch("cli_bad_config", checkpoints, tmp_path)
    assert status == 1, (status, out, err)
    assert re.search(r"^RANK 1 EXIT 1 ", out, re.M) and re.search(r"^RANK 0 EXIT 1 ", out,
                                                                  re.M), out
    lines = [ln for ln in err.splitlines() if ln.startswith("metrale: error:")]
    assert any(re.search(r"bad_config/config\.json: not valid JSON", ln) and
               "rank 1 of 2 failed" not in ln for ln in lines), err
    assert any("tensor parallel: rank 1 of 2 failed: " in ln and "bad_config/config.json"
               in ln for ln in lines), err
    assert not NOISE.search(err), err
    assert wall < 30, wall


def test_a_rank_that_never_joins_ends_the_wait_after_the_timeout(checkpoints, tmp_path):
    status, out, err, wall = launch("never_joins", checkpoints, tmp_path)
    assert status != 0
    assert re.match(r"TensorParallelError after [\d.]+ s: tensor parallel: rank 0 of 2: the "
                    r"other ranks did not start MPI within 3\.0 s", raised(out, 0)), out
    assert wall < 15, wall


def check_aborted(status: int, out: str, err: str, wall: float, ranks) -> None:
    assert status == 130, (status, out, err)
    assert sorted(INTERRUPTED.findall(err)) in ranks, err
    assert len(err.strip().splitlines()) == len(INTERRUPTED.findall(err)), err
    assert not NOISE.search(err + out), err + out
    assert "DECODED ALL" not in out and "RETURNED" not in out
    assert wall < 20, wall   # the ranks' timeout is 60 s


@pytest.mark.parametrize("rank", [0, 1])
def test_sigint_to_one_rank_aborts_the_job(checkpoints, tmp_path, rank):
    check_aborted(*launch(f"interrupt{rank}", checkpoints, tmp_path), ranks=[[str(rank)]])


def test_sigint_to_the_process_group_aborts_the_job(checkpoints, tmp_path):
    """Ctrl-C in a terminal: the whole foreground group gets SIGINT and mpiexec forwards it
    to every rank; one rank's abort may kill the other before it writes its line."""
    check_aborted(*launch("decode_forever", checkpoints, tmp_path, interrupt_group=True),
                  ranks=[["0"], ["1"], ["0", "1"]])


def test_an_interrupt_before_the_group_exists_still_aborts_the_job(checkpoints, tmp_path):
    """The CLI's KeyboardInterrupt path (end_interrupted_job) on a rank that never joined:
    it joins MPI so that its abort reaches rank 0, which would otherwise wait 60 s."""
    check_aborted(*launch("interrupted_early", checkpoints, tmp_path), ranks=[["1"]])


def test_metrale_command_interrupted_before_the_group_exists(checkpoints, tmp_path):
    """`metrale bench --tensor-parallel 2`, rank 1 interrupted while it opens the checkpoint:
    the whole job ends with 130 (rank 0's default 300 s timeout never runs out)."""
    status, out, err, wall = launch("cli_interrupted_early", checkpoints, tmp_path)
    check_aborted(status, out, err, wall, ranks=[["1"]])
    assert "metrale: interrupted" not in err


def test_metrale_command_gets_ctrl_c(checkpoints, tmp_path):
    """`mpiexec -n 2 metrale bench --tensor-parallel 2` and Ctrl-C once the ranks loaded the
    model: the job ends with 130 at once, no traceback on any rank."""
    check_aborted(*launch("cli_bench", checkpoints, tmp_path, interrupt_group=True),
                  ranks=[["0"], ["1"], ["0", "1"]])


def test_an_expert_parallel_all_to_all_that_raises_ends_every_rank(checkpoints, tmp_path):
    """Expert parallelism, rank 1's all-to-all raises in a decode step (after the step's
    agreement, rank 0 already waiting in the same collective): rank 1 raises its own error
    and announces it, rank 0 raises TensorParallelError naming rank 1 and its error at once
    (not after its 30 s timeout), and the job ends non-zero (comm/notice.py)."""
    status, out, err, wall = launch("ep_alltoall_raises", checkpoints, tmp_path)
    assert status != 0, (out, err)
    assert re.match(r"RuntimeError after [\d.]+ s: injected all-to-all failure$",
                    raised(out, 1)), out
    assert re.match(r"TensorParallelError after [\d.]+ s: tensor parallel: rank 1 of 2 failed "
                    r"mid-step: RuntimeError: injected all-to-all failure; the group is broken",
                    raised(out, 0)), out
    assert "metrale: rank 1 of 2 failed mid-step: RuntimeError: injected all-to-all failure" \
        in err, err
    assert "DECODED ALL" not in out
    assert wall < 20, wall   # the notice, not the ranks' 30 s timeout


def test_an_expert_parallel_rank_that_fails_before_the_communicator_ends_every_rank(
        checkpoints, tmp_path):
    status, out, err, wall = launch("ep_bad_config", checkpoints, tmp_path)
    assert status != 0
    assert re.match(r"FormatError after [\d.]+ s: \S*moe_bad_config/config\.json: not valid "
                    r"JSON", raised(out, 1)), out
    assert re.match(r"FormatError after [\d.]+ s: tensor parallel: rank 1 of 2 failed: "
                    r"\S*moe_bad_config/config\.json: not valid JSON", raised(out, 0)), out
    assert "LOADED" not in out
    assert wall < 20, wall   # the error, not the ranks' 30 s timeout


def test_a_job_that_exits_without_teardown_ends_quietly(checkpoints, tmp_path):
    """The group's pending failure-notice receive (comm/notice.py) is withdrawn at exit:
    MPI finalizes without a warning about it (UCX printed one per rank without that)."""
    status, out, err, wall = launch("no_teardown", checkpoints, tmp_path)
    assert status == 0, (out, err)
    assert out.count("DECODED ALL") == 2
    assert err.strip() == "", err
    assert "WARN" not in out and "not returned" not in out, out   # UCX writes to stdout


def test_sigint_to_one_expert_parallel_rank_aborts_the_job(checkpoints, tmp_path):
    check_aborted(*launch("ep_interrupt1", checkpoints, tmp_path), ranks=[["1"]])


@pytest.mark.parametrize("case", ["terminate1", "ep_terminate1"])
def test_sigterm_to_one_rank_ends_the_job(checkpoints, tmp_path, case):
    """SIGTERM (what a batch scheduler or `kill` sends) keeps its default action: the rank
    ends at once, and mpiexec, seeing a rank end by a signal, ends the others and returns
    non-zero, well inside the ranks' 60 s timeout (tensor and expert parallel)."""
    status, out, err, wall = launch(case, checkpoints, tmp_path)
    assert status != 0, (status, out, err)
    assert "DECODED ALL" not in out and "RETURNED" not in out
    assert wall < 20, wall


def test_the_sigint_handler_is_held_while_a_group_lives():
    """In one process: the job abort replaces Python's default SIGINT handler while any
    group holds it and puts it back after the last; a program's own handler is kept."""
    from metrale.gpu_runtime.comm.interrupts import AbortOnInterrupt
    default = signal.default_int_handler
    # Python's handler, as an interactive run has it (a background job, e.g. CI's lanes,
    # starts with SIGINT ignored; put back at the end)
    before = signal.signal(signal.SIGINT, default)
    try:
        _held_and_released(AbortOnInterrupt, default)
    finally:
        signal.signal(signal.SIGINT, before)


def _held_and_released(AbortOnInterrupt, default):
    first, second = AbortOnInterrupt(0, 2), AbortOnInterrupt(0, 2)
    try:
        assert signal.getsignal(signal.SIGINT) is not default
        first.release()
        first.release()   # twice is once
        assert signal.getsignal(signal.SIGINT) is not default
    finally:
        second.release()
    assert signal.getsignal(signal.SIGINT) is default

    def own(signum, frame):
        pass
    signal.signal(signal.SIGINT, own)
    try:
        held = AbortOnInterrupt(0, 2)
        assert signal.getsignal(signal.SIGINT) is own
        held.release()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, default)
