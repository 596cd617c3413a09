"""The SPMD program of the failure launches: `mpiexec -n 2 python -m tests.tp.job_failures
CASE DIR OUT`, one case per launch (each ends the job). DIR holds copies of the llama_gqa fixture:
good/, bad_config/ (config.json not JSON), truncated/ (model.safetensors cut short).
tests/tp/test_tp_failures.py starts it and asserts on the exit status, the output and the
wall time.

  bad_config, truncated  rank 1 loads the damaged copy, rank 0 the good one
  never_joins            rank 1 exits before it calls metrale.load
  interrupt0, interrupt1 rank R sends itself SIGINT in the middle of a decode loop
  decode_forever         both ranks decode until something ends the job (the test signals
                         the whole process group)
  interrupted_early      rank 1 is interrupted before it joined the group (the CLI's path:
                         end_interrupted_job); rank 0 loads and decodes
  cli_interrupted_early  `metrale bench --tensor-parallel 2` where rank 1 is interrupted while
                         it opens the checkpoint, before the group exists
  cli_bad_config         `metrale bench --tensor-parallel 2` where rank 1's checkpoint has a
                         bad config.json (the command opens it before the group exists)
  ep_alltoall_raises     expert parallel (DIR/moe: mixtral): rank 1's fifth all-to-all
                         raises mid-step (in the first decode step)
  ep_interrupt1          expert parallel: rank 1 sends itself SIGINT in a decode loop
  terminate1, ep_terminate1  rank 1 sends itself SIGTERM in a decode loop (tensor / expert
                         parallel)
  no_teardown            both ranks decode a few tokens and exit without teardown
  ep_bad_config          expert parallel: rank 1 loads DIR/moe_bad_config (config.json not
                         JSON), rank 0 DIR/moe
Every rank writes "RANK r ..." lines to OUT/rank<r>.txt (what it raised, how far it got):
mpiexec interleaves the ranks' stdout, not always at line ends.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import metrale
from metrale.gpu_runtime.comm.ranks import launcher_ranks

RANK = launcher_ranks().rank
OUT: Path | None = None
KEPT: list = []


def say(text: str) -> None:
    with open(OUT / f"rank{RANK}.txt", "a") as f:
        f.write(f"RANK {RANK} {text}\n")


def load(path, timeout_s: float):
    return metrale.load(path, "cpu", tensor_parallel_size=2, progress=False,
                        tp_timeout_s=timeout_s)


def load_one_bad(d: Path, bad: str, timeout_s: float = 30) -> int:
    path = d / bad if RANK == 1 else d / "good"
    t0 = time.monotonic()
    try:
        load(path, timeout_s)
    except metrale.MetraleError as e:
        say(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")
        return 1
    say("LOADED")
    return 0


def decode(m, steps: int, signal_at: int | None = None, sig=signal.SIGINT) -> None:
    """Decode `steps` tokens, one every few ms; `sig` to this rank before step `signal_at`."""
    s = m.default_stream()
    seq = m.alloc_sequence()
    m.prefill([1, 2, 3], seq, s)
    say("DECODING")
    for t in range(steps):
        if t == signal_at:
            os.kill(os.getpid(), sig)
        m.decode(4 + t % 50, seq, s)
        time.sleep(0.005)
    say("DECODED ALL")


def load_ep(d: Path, name: str = "moe"):
    return metrale.load(d / name, "cpu", tensor_parallel_size=2, progress=False,
                        tp_timeout_s=30, expert_parallel=True)


def ep_bad_config(d: Path) -> int:
    t0 = time.monotonic()
    try:
        load_ep(d, "moe_bad_config" if RANK == 1 else "moe")
    except metrale.MetraleError as e:
        say(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")
        return 1
    say("LOADED")
    return 0


def ep_alltoall_raises(d: Path) -> int:
    m = load_ep(d)
    if RANK == 1:
        comm, calls = m._tp.comm, []
        real = comm.all_to_all_v

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("injected all-to-all failure")
            return real(*args, **kwargs)
        comm.all_to_all_v = failing
    t0 = time.monotonic()
    try:
        decode(m, 50)
    except Exception as e:   # noqa: BLE001 - what each rank raised is the test's subject
        say(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}")
        return 1
    return 0


def main(case: str, d: Path) -> int:
    if case == "ep_alltoall_raises":
        return ep_alltoall_raises(d)
    if case == "ep_bad_config":
        return ep_bad_config(d)
    if case == "no_teardown":   # the model lives on until the interpreter exits
        KEPT.append(load(d / "good", 60))
        decode(KEPT[0], 3)
        return 0
    if case == "ep_interrupt1":
        decode(load_ep(d), 200, signal_at=6 if RANK == 1 else None)
        return 0
    if case in ("bad_config", "truncated"):
        return load_one_bad(d, case)
    if case == "never_joins":
        if RANK == 1:
            return 3
        return load_one_bad(d, "good", timeout_s=3)
    if case in ("interrupt0", "interrupt1"):
        m = load(d / "good", 60)
        decode(m, 200, signal_at=6 if case == f"interrupt{RANK}" else None)
        return 0
    if case in ("terminate1", "ep_terminate1"):   # SIGTERM (a scheduler's kill): no handler
        m = load_ep(d) if case == "ep_terminate1" else load(d / "good", 60)
        decode(m, 200, signal_at=6 if RANK == 1 else None, sig=signal.SIGTERM)
        return 0
    if case == "decode_forever":
        decode(load(d / "good", 60), 100_000)
        return 0
    if case == "interrupted_early":
        if RANK == 1:
            from metrale.gpu_runtime.comm.interrupts import end_interrupted_job
            end_interrupted_job(2)
            say("RETURNED FROM end_interrupted_job")
            return 0
        decode(load(d / "good", 60), 2000)
        return 0
    if case == "cli_interrupted_early":
        import metrale.cli
        from metrale.cli import checkpoint
        if RANK == 1:
            def interrupted(_model):
                raise KeyboardInterrupt
            checkpoint.open_checkpoint = interrupted
        return metrale.cli.main(["bench", str(d / "good"), "--device", "cpu", "--batch", "1",
                                 "--prompt-len", "4", "--gen-len", "200",
                                 "--tensor-parallel", "2"])
    if case == "cli_bad_config":   # rank 1's copy of the checkpoint is damaged
        import metrale.cli
        path = d / ("bad_config" if RANK == 1 else "good")
        t0 = time.monotonic()
        rc = metrale.cli.main(["bench", str(path), "--device", "cpu", "--batch", "1",
                               "--prompt-len", "4", "--gen-len", "4", "--tensor-parallel", "2"])
        say(f"EXIT {rc} after {time.monotonic() - t0:.1f} s")
        return rc
    if case == "cli_bench":
        import metrale.cli
        from metrale.bench import tensor_parallel

        def load_model(*args, **kwargs):
            model = load_model.original(*args, **kwargs)
            say("DECODING")
            return model
        load_model.original = tensor_parallel.load_model
        tensor_parallel.load_model = load_model
        return metrale.cli.main(["bench", str(d / "good"), "--device", "cpu", "--batch",
                                 "1,2,3,4", "--prompt-len", "4", "--gen-len", "400",
                                 "--tensor-parallel", "2"])
    raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    OUT = Path(sys.argv[3])
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
