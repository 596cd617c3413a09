#!/usr/bin/env bash
# GPU tests and benchmarks, one JSON per tool in OUTDIR. Each invocation fits one device
# call (10 minutes): the default set within 8 minutes on an H200 (455 s of tool limits),
# --moe the mixture-of-experts set alone (600 s of limits) as a second call:
#   gpu_tests.json      pytest -m gpu (passed/failed counted from its junit xml)
#   bench_kernels.json  benchmarks/bench_kernels.py at Llama-3.1-8B shapes
#   bench.json          metrale bench --preset llama-3.1-8b --batch 1,8,64
#   compare_hf.json     benchmarks/compare_hf.py (metrale bench --compare-hf: metrale vs
#                       transformers on the same weights, plus HF torch.compile)
# with --moe instead:
#   bench_moe.json      metrale bench --preset qwen3-30b-a3b --batch 1,64 (roofline from the
#                       active experts' bytes; 61 GB of weights)
#   compare_hf_moe.json the same against transformers bf16 in one run (needs ~125 GB: run
#                       where the GPU has >= 135 GiB, else recorded as skipped)
#   bench_mixtral.json  metrale bench --preset mixtral-8x7b --batch 1,64 (93 GB: >= 110 GiB)
#   suite.json          every tool's rc and wall time
#   estimate_vs_measured.json  the EmuBackend's committed ESTIMATE
#                       (benchmarks/results/emu_profile.json) next to bench.json's decode
#                       step and bench_kernels.json's GEMMs (benchmarks/estimate_vs_measured.py),
#                       also printed
# Each JSON carries the command, GPU name, driver, CuPy/CUDA versions and
# "gpu_tests": {"passed", "failed"}. Works from a checkout with no pip install (the repo
# goes on PYTHONPATH; the CLI runs as `python -m metrale.cli`). A failing or timed-out tool
# is recorded ("rc", "error" with the tail of its log) and the suite goes on.
#
# With --tensor-parallel N (N > 1) the bench tool runs as N ranks, one process per GPU (the
# mpich wheel's mpiexec when it is installed, else N processes started here with the
# RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables torchrun sets), at
# the Llama-3.1-70B shape by default, and bench.json gains each step's all-reduce time.
#
# usage: benchmarks/gpu_suite.sh OUTDIR [--moe | --tensor-parallel N] [--preset NAME]
#        (env: PYTHON, default python3)
set -uo pipefail

usage() {
    echo "usage: $0 OUTDIR [--moe | --tensor-parallel N] [--preset NAME]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
OUTARG=$1
shift
TP=1
PRESET_ARG=
MOE=0
while [ $# -gt 0 ]; do
    case $1 in
        --moe) MOE=1; shift ;;
        --tensor-parallel) [ $# -ge 2 ] || usage; TP=$2; shift 2 ;;
        --preset) [ $# -ge 2 ] || usage; PRESET_ARG=$2; shift 2 ;;
        *) usage ;;
    esac
done
case $TP in ''|*[!0-9]*|0) echo "--tensor-parallel wants a positive integer" >&2; exit 2 ;; esac
[ "$MOE" = 1 ] && [ "$TP" -gt 1 ] && { echo "--moe runs on one GPU (no --tensor-parallel)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUTARG" || exit 2
OUT=$(cd "$OUTARG" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 2
SUITE_START=$(date +%s)

# ranks CMD...: CMD as TP processes, one per rank (CMD itself when TP is 1)
ranks() {
    if [ "$TP" -eq 1 ]; then
        "$@"
        return
    fi
    local mpi
    mpi=$(dirname "$(command -v "$PY")")/mpiexec
    if [ -x "$mpi" ]; then
        "$mpi" -n "$TP" "$@"
        return
    fi
    local pids=() r rc=0
    trap 'kill "${pids[@]}" 2>/dev/null' TERM INT
    for ((r = 0; r < TP; r++)); do
        RANK=$r WORLD_SIZE=$TP LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=${MASTER_PORT:-29400} "$@" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    return $rc
}
export -f ranks
export TP PY

# run NAME TIMEOUT_S CMD...: log to OUT/NAME.log, rc and wall time to OUT/NAME.status
run() {
    local name=$1 limit=$2
    shift 2
    local t0 t1 rc
    t0=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*" >&2
    # through bash, so that CMD may be the `ranks` function
    timeout --signal=TERM --kill-after=15 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    t1=$(date +%s%N)
    printf '{"rc": %d, "wall_s": %d.%03d, "limit_s": %d, "command": %s}\n' "$rc" \
        $(((t1 - t0) / 1000000000)) $((((t1 - t0) / 1000000) % 1000)) "$limit" \
        "$("$PY" -c 'import json,sys; print(json.dumps(" ".join(sys.argv[1:])))' "$@")" \
        >"$OUT/$name.status"
    echo "   rc=$rc" >&2
    tail -n 3 "$OUT/$name.log" >&2
}

# METRALE_SUITE_SMOKE=1: the same flow at toy sizes on the CPU (checks this script).
if [ "${METRALE_SUITE_SMOKE:-0}" = 1 ]; then
    PRESET=tiny; DEV=(--device cpu); KSMALL=(--small); BENCH_SIZE=(--batch 1,2 --prompt-len 16
        --gen-len 4); HF_SIZE=(--batch 1 --prompt-len 16 --gen-len 4)
    TEST_DEVICE=emu; TESTS=(tests/ops/test_argmax.py)   # the flow, not the kernels
    MOE_PRESET=tiny-moe; MIXTRAL_PRESET=tiny-moe; MOE_SIZE=(--batch 1,2 --prompt-len 16
        --gen-len 4); MOE_HF_SIZE=(--batch 1 --prompt-len 16 --gen-len 4); GPU_GIB=1000
else
    PRESET=llama-3.1-8b; DEV=(); KSMALL=(); BENCH_SIZE=(--batch 1,8,64 --max-seconds 120)
    # the kernels on the GPU only: their emulated runs are CI's (minutes on 16 cores)
    TEST_DEVICE=cuda; TESTS=(tests)
    HF_SIZE=(--batch 1,8 --gen-len 64 --compile-batches 1)
    MOE_PRESET=qwen3-30b-a3b; MIXTRAL_PRESET=mixtral-8x7b
    MOE_SIZE=(--batch 1,64 --prompt-len 256 --gen-len 64 --max-seconds 90)
    MOE_HF_SIZE=(--batch 1,64 --prompt-len 256 --gen-len 32 --reps 1 --no-compile)
    GPU_GIB=$("$PY" -c 'import cupy; print(cupy.cuda.runtime.memGetInfo()[1] >> 30)' \
        2>/dev/null || echo 0)
    if [ "$TP" -gt 1 ]; then   # the ranks must time the same steps: no time budget
        PRESET=llama-3.1-70b; BENCH_SIZE=(--batch 1,8,64 --prompt-len 256 --gen-len 32)
    fi
fi
BENCH_PRESET=${PRESET_ARG:-$PRESET}
TP_ARGS=()
[ "$TP" -gt 1 ] && TP_ARGS=(--tensor-parallel "$TP")

# skip NAME REASON: a tool left out on this machine, recorded as such
skip() {
    local name=$1
    shift
    printf '{"rc": null, "skipped": %s}\n' \
        "$("$PY" -c 'import json,sys; print(json.dumps(" ".join(sys.argv[1:])))' "$@")" \
        >"$OUT/$name.status"
    echo "== $name skipped: $*" >&2
}

if [ "$MOE" = 0 ]; then
    # Budget (seconds; 455 worst case, leaving room for start-up and the merge below).
    run gpu_tests 150 env METRALE_DEVICE="$TEST_DEVICE" "$PY" -m pytest -m gpu -q \
        -p no:cacheprovider --junitxml "$OUT/pytest_gpu.xml" "${TESTS[@]}"
    run bench_kernels 55 "$PY" benchmarks/bench_kernels.py "${DEV[@]}" "${KSMALL[@]}" \
        --json "$OUT/bench_kernels.json"
    run bench 130 ranks "$PY" -m metrale.cli bench --preset "$BENCH_PRESET" "${DEV[@]}" \
        "${BENCH_SIZE[@]}" "${TP_ARGS[@]}" --json "$OUT/bench.json"
    run compare_hf 120 "$PY" benchmarks/compare_hf.py --preset "$PRESET" "${DEV[@]}" \
        "${HF_SIZE[@]}" --json "$OUT/compare_hf.json"
    for t in bench_moe compare_hf_moe bench_mixtral; do skip "$t" "run with --moe"; done
else
    # Mixture of experts (issue 25), 600 s worst case: generating and uploading the weights
    # takes ~1 minute of each tool.
    for t in gpu_tests bench_kernels bench compare_hf; do skip "$t" "run without --moe"; done
    run bench_moe 180 "$PY" -m metrale.cli bench --preset "$MOE_PRESET" "${DEV[@]}" \
        "${MOE_SIZE[@]}" --json "$OUT/bench_moe.json"
    if [ "$GPU_GIB" -ge 135 ]; then
        run compare_hf_moe 240 "$PY" benchmarks/compare_hf.py --preset "$MOE_PRESET" \
            "${DEV[@]}" "${MOE_HF_SIZE[@]}" --json "$OUT/compare_hf_moe.json"
    else
        skip compare_hf_moe "metrale's and transformers' copies of $MOE_PRESET need ~125 GB;" \
            "the GPU has ${GPU_GIB} GiB"
    fi
    if [ "$GPU_GIB" -ge 110 ]; then
        run bench_mixtral 180 "$PY" -m metrale.cli bench --preset "$MIXTRAL_PRESET" \
            "${DEV[@]}" "${MOE_SIZE[@]}" --json "$OUT/bench_mixtral.json"
    else
        skip bench_mixtral "$MIXTRAL_PRESET needs 93 GB of weights; the GPU has ${GPU_GIB} GiB"
    fi
fi

# Merge: environment, command, rc/error and the GPU test counts into every tool's JSON.
"$PY" - "$OUT" "$SUITE_START" <<'PY'
import json, re, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, start = Path(sys.argv[1]), float(sys.argv[2])
tools = ["gpu_tests", "bench_kernels", "bench", "compare_hf", "bench_moe", "compare_hf_moe",
         "bench_mixtral"]


def gpu_test_counts():
    xml = out / "pytest_gpu.xml"
    if xml.is_file():
        try:
            root = ET.parse(xml).getroot()
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            n = {k: sum(int(s.get(k, 0)) for s in suites)
                 for k in ("tests", "failures", "errors", "skipped")}
            return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
                    "failed": n["failures"] + n["errors"], "skipped": n["skipped"],
                    "source": "junit"}
        except Exception as e:  # fall back to the summary line
            pass
    log = out / "gpu_tests.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "source": "summary"}
    for num, word in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", text):
        key = {"error": "failed", "errors": "failed"}.get(word, word)
        counts[key] += int(num)
    return counts


try:
    from metrale.bench.env import environment
    from metrale.gpu_runtime import backend
    env = environment(backend("auto"))
except Exception as e:
    env = {"device": None, "gpu_name": None, "driver": None, "cupy": None, "cuda": None,
           "env_error": f"{type(e).__name__}: {e}"}
tests = gpu_test_counts()
summary = {"tools": {}, "gpu_tests": tests, **env}
for name in tools:
    status_p, json_p = out / f"{name}.status", out / f"{name}.json"
    status = json.loads(status_p.read_text()) if status_p.is_file() else {"rc": None}
    try:
        data = json.loads(json_p.read_text()) if json_p.is_file() else {}
    except ValueError as e:
        data = {"json_error": f"{json_p.name} is not valid JSON: {e}"}
    tool_cmd = data.get("command")
    for k, v in env.items():
        if data.get(k) is None:
            data[k] = v
    data["command"] = status.get("command", tool_cmd)
    if tool_cmd and tool_cmd != data["command"]:
        data["tool_command"] = tool_cmd
    data["rc"] = status.get("rc")
    if status.get("skipped"):
        data["skipped"] = status["skipped"]
        json_p.write_text(json.dumps(data, indent=1) + "\n")
        summary["tools"][name] = {"rc": None, "skipped": status["skipped"]}
        continue
    data["wall_s"] = status.get("wall_s", data.get("wall_s"))
    data["gpu_tests"] = tests
    if status.get("rc") not in (0,):
        log = out / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else []
        why = "timed out" if status.get("rc") in (124, 137) else f"exit {status.get('rc')}"
        data["error"] = why + (": " + "\n".join(tail) if tail else "")
    json_p.write_text(json.dumps(data, indent=1) + "\n")
    summary["tools"][name] = {"rc": status.get("rc"), "wall_s": status.get("wall_s"),
                              "json": json_p.name}
summary["wall_s"] = time.time() - start
(out / "suite.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary["tools"]), file=sys.stderr)
print(f"gpu tests: {tests['passed']} passed, {tests['failed']} failed", file=sys.stderr)
PY

# The emulator's estimate next to what this GPU measured (printed and kept as JSON).
"$PY" benchmarks/estimate_vs_measured.py --bench "$OUT/bench.json" \
    --kernels "$OUT/bench_kernels.json" --json "$OUT/estimate_vs_measured.json" >&2 || true
