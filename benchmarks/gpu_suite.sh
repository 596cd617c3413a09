#!/usr/bin/env bash
# GPU tests and benchmarks, one JSON per tool in OUTDIR (within 8 minutes on an H200):
#   gpu_tests.json      pytest -m gpu (passed/failed counted from its junit xml)
#   bench_kernels.json  benchmarks/bench_kernels.py at Llama-3.1-8B shapes
#   bench.json          metrale bench --preset llama-3.1-8b --batch 1,8,64
#   compare_hf.json     benchmarks/compare_hf.py (metrale bench --compare-hf: metrale vs
#                       transformers on the same weights, plus HF torch.compile)
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
# usage: benchmarks/gpu_suite.sh OUTDIR        (env: PYTHON, default python3)
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 2
SUITE_START=$(date +%s)

# run NAME TIMEOUT_S CMD...: log to OUT/NAME.log, rc and wall time to OUT/NAME.status
run() {
    local name=$1 limit=$2
    shift 2
    local t0 t1 rc
    t0=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*" >&2
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
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
else
    PRESET=llama-3.1-8b; DEV=(); KSMALL=(); BENCH_SIZE=(--batch 1,8,64 --max-seconds 120)
    HF_SIZE=(--batch 1,8 --gen-len 64 --compile-batches 1)
fi

# Budget (seconds; 455 worst case, leaving room for start-up and the merge below).
run gpu_tests 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml "$OUT/pytest_gpu.xml" tests
run bench_kernels 55 "$PY" benchmarks/bench_kernels.py "${DEV[@]}" "${KSMALL[@]}" \
    --json "$OUT/bench_kernels.json"
run bench 130 "$PY" -m metrale.cli bench --preset "$PRESET" "${DEV[@]}" "${BENCH_SIZE[@]}" \
    --json "$OUT/bench.json"
run compare_hf 120 "$PY" benchmarks/compare_hf.py --preset "$PRESET" "${DEV[@]}" \
    "${HF_SIZE[@]}" --json "$OUT/compare_hf.json"

# Merge: environment, command, rc/error and the GPU test counts into every tool's JSON.
"$PY" - "$OUT" "$SUITE_START" <<'PY'
import json, re, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, start = Path(sys.argv[1]), float(sys.argv[2])
tools = ["gpu_tests", "bench_kernels", "bench", "compare_hf"]


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
