#!/usr/bin/env bash
# One prepared check of tidal on the lent GPU machine (issue 14, item 7), in under 8 minutes:
#   setup         install the carried wheels (.whl/, made by scripts/fetch_device_wheels.sh) into
#                 /tmp/tidal_site, make `import tidal` work from this checkout (a symlink shim:
#                 tidal -> tidal_pkg, tidal.protocol -> protocol, ...), print GPU and versions
#   triton_tests  tests/test_triton_attention.py with the kernels compiled on the GPU (TRITON_INTERPRET
#                 unset), compared with the torch reference on the CPU
#   gpu_tests     python3 -m pytest -m gpu tests/test_gpu.py (and any other file with gpu-marked
#                 tests that does not switch the Triton interpreter on)
#   bench         scripts/device_bench.py: Qwen3-0.6B (dummy weights), 256 seqs, efficiency
#                 against the physical floor, transformers, forward-only decode step
# Each phase runs under its own timeout, cut to what is left of the whole budget
# (DEVICE_CHECK_BUDGET_S, default 470 s), so one hang cannot eat the rest. The summary (phase
# status passed/failed/timed_out/skipped, per-test outcomes, the benchmark's numbers) is
# printed last and written to $OUT/summary.json (./device_out without $OUT), beside bench.json
# and the full log device_check.log.
#
# On the device machine (the `run` tool), from the repository root:
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=540)
# Here, on the CPU (tiny model, tiny workload, the same phases; checks this script):
#   DEVICE_CHECK_SMOKE=1 scripts/device_check.sh
# Other knobs: DEVICE_CHECK_PHASES="gpu_tests bench triton_tests" (a subset), DEVICE_CHECK_PYTEST_ARGS
# (extra pytest args for gpu_tests, e.g. "-k graphs"), DEVICE_CHECK_BENCH_ARGS (extra bench args,
# e.g. "--enforce-eager" or "--hf-seqs 0").
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
# ---------------------------------------------------------------- setup
setup() {
    set -e
    if [ "$SMOKE" = 1 ] && [ "${DEVICE_CHECK_INSTALL:-0}" != 1 ]; then
        echo "smoke: the wheels are not installed here (cp312 wheels; this machine has its own packages)"
    elif ls .whl/*.whl >/dev/null 2>&1; then
        ls -l .whl
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    else
        echo "no .whl/*.whl: run scripts/fetch_device_wheels.sh here and carry .whl"
    fi
    "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"cc {p.major}.{p.minor}", f"{p.multi_processor_count} SMs")
for name in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "zmq", "msgspec", "uvloop",
             "psutil", "prometheus_client", "tqdm", "pytest", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING:", type(e).__name__, e)
import tidal, tidal.frontend, tidal.worker.model_runner, tidal.core.engine_core  # noqa: E401,F401
print("tidal", tidal.__version__, "from", tidal.__file__)
EOF
    if [ "$SMOKE" != 1 ]; then
        nvidia-smi || echo "nvidia-smi failed"
    fi
}


if [ "${1:-}" = __setup ]; then  # the setup phase, run by run_phase below in its own process
    setup
    exit
fi
SMOKE=${DEVICE_CHECK_SMOKE:-0}
OUT_DIR=${OUT:-$ROOT/device_out}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/device_check.XXXXXX)
LOG=$OUT_DIR/device_check.log
PHASES_FILE=$WORK/phases.tsv
: >"$LOG"
: >"$PHASES_FILE"
START=$(date +%s)
DEADLINE=$((START + ${DEVICE_CHECK_BUDGET_S:-470}))
PHASES=${DEVICE_CHECK_PHASES:-"setup triton_tests gpu_tests bench"}
PY=${DEVICE_CHECK_PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$LOG") 2>&1

say() { echo "[device_check $(($(date +%s) - START))s] $*"; }
wants() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# phase_limit CAP_S: min(CAP_S, time left before the deadline - 15 s)
phase_limit() {
    local left=$((DEADLINE - $(date +%s) - 15))
    echo $(($1 < left ? $1 : left))
}

# run_phase NAME CAP_S CMD...: runs CMD under timeout phase_limit(CAP_S); records
# NAME status rc seconds in $PHASES_FILE.
run_phase() {
    local name=$1 cap=$2
    shift 2
    local limit
    limit=$(phase_limit "$cap")
    if [ "$limit" -lt 10 ]; then
        say "$name: skipped (no time left)"
        printf '%s\tskipped\t-\t0\tno time left\n' "$name" >>"$PHASES_FILE"
        return
    fi
    say "$name: start (timeout ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    # SIGINT first: pytest then still writes its junit XML and summary, the bench its finally
    timeout -s INT -k 15 "$limit" "$@"
    rc=$?
    case $rc in
        0) status=passed ;;
        124 | 130 | 137) status=timed_out ;;
        *) status=failed ;;
    esac
    say "$name: $status (rc $rc, $(($(date +%s) - t0))s)"
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" >>"$PHASES_FILE"
}

skip_phase() {
    say "$1: skipped ($2)"
    printf '%s\tskipped\t-\t0\t%s\n' "$1" "$2" >>"$PHASES_FILE"
}

# `import tidal` from this checkout without installing it: the package-dir mapping of
# pyproject.toml as symlinks (subpackages nest inside their folders already).
SITE=/tmp/tidal_site
SHIM=$WORK/shim
mkdir -p "$SHIM/tidal"
ln -s "$ROOT/tidal_pkg/__init__.py" "$SHIM/tidal/__init__.py"
for d in protocol frontend core worker; do ln -s "$ROOT/$d" "$SHIM/tidal/$d"; done
export PYTHONPATH="$SHIM:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The engine's C kernels (CPU only) and tokenizers cache under here, not in a home folder.
export TIDAL_CACHE_DIR=${TIDAL_CACHE_DIR:-$WORK/tidal-cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # that machine has no network: never try the hub

say "mode: $([ "$SMOKE" = 1 ] && echo "CPU smoke" || echo device); out: $OUT_DIR; phases: $PHASES"
if wants setup; then run_phase setup 60 env SMOKE="$SMOKE" PY="$PY" SITE="$SITE" bash "$ROOT/scripts/device_check.sh" __setup; fi

# ---------------------------------------------------------------- Triton attention tests
if wants triton_tests; then
    if [ ! -f tests/test_triton_attention.py ]; then
        skip_phase triton_tests "tests/test_triton_attention.py does not exist"
    elif [ "$SMOKE" = 1 ]; then
        # only collected here: they run under TRITON_INTERPRET=1 in CI already
        run_phase triton_tests 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/test_triton_attention.py
    else  # with CUDA the file runs the kernels compiled, compared on the CPU with the reference
        run_phase triton_tests 90 env -u TRITON_INTERPRET "$PY" -m pytest -v -rA -p no:cacheprovider \
            --timeout 120 --junitxml="$WORK/triton_tests.xml" tests/test_triton_attention.py
    fi
fi

# ---------------------------------------------------------------- GPU tests
if wants gpu_tests; then
    if [ "$SMOKE" = 1 ]; then
        # the same tests on the CPU: a few, to keep the smoke run short
        run_phase gpu_tests 300 env TIDAL_GPU_TESTS_ON_CPU=1 "$PY" -m pytest -q -rA -p no:cacheprovider -m gpu \
            --junitxml="$WORK/gpu_tests.xml" tests/test_gpu.py \
            -k "${DEVICE_CHECK_SMOKE_TESTS:-fp32_equals and qwen3 or prefix_cache or preemption}" \
            ${DEVICE_CHECK_PYTEST_ARGS:-}
    else
        # every test file with gpu-marked tests, but none that turns the Triton interpreter on at
        # import (it would hold for the whole session and send the CUDA kernels to it)
        gpu_files=$(grep -l 'pytest.mark.gpu' tests/test_*.py | xargs -r grep -L '^os.environ\["TRITON_INTERPRET"\]')
        run_phase gpu_tests 130 "$PY" -m pytest -v -rA -p no:cacheprovider -m gpu --timeout 120 \
            --junitxml="$WORK/gpu_tests.xml" ${gpu_files:-tests/test_gpu.py} ${DEVICE_CHECK_PYTEST_ARGS:-}
    fi
fi

# ---------------------------------------------------------------- benchmark
if wants bench; then
    if [ "$SMOKE" = 1 ]; then
        run_phase bench 300 "$PY" scripts/device_bench.py --smoke --device cpu --out "$OUT_DIR/bench.json" \
            ${DEVICE_CHECK_BENCH_ARGS:-}
    else
        # its optional parts (transformers, forward-only) are skipped past 25 s before its timeout
        limit=$(phase_limit 230)
        run_phase bench 230 "$PY" scripts/device_bench.py --device cuda --budget-s $((limit > 75 ? limit - 25 : limit * 2 / 3)) \
            --out "$OUT_DIR/bench.json" ${DEVICE_CHECK_BENCH_ARGS:-}
    fi
fi

# ---------------------------------------------------------------- summary
"$PY" - "$PHASES_FILE" "$WORK" "$OUT_DIR" "$SMOKE" "$START" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

phases_file, work, out_dir, smoke, start = sys.argv[1:]
phases = {}
for line in open(phases_file):
    name, status, rc, secs, note = (line.rstrip("\n").split("\t") + [""])[:5]
    phases[name] = {"status": status, "rc": rc, "seconds": int(secs)} | ({"note": note} if note else {})


def tests(xml_path):
    if not os.path.exists(xml_path):
        return None
    out = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name")
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"
            elif child.tag == "skipped":
                kind = "skipped"
        out[kind].append(name)
    return {k: v for k, v in out.items() if v or k != "skipped"} | {k + "_count": len(v) for k, v in out.items()}


for name in ("gpu_tests", "triton_tests"):
    t = tests(os.path.join(work, f"{name}.xml"))
    if t is not None and name in phases:
        phases[name]["tests"] = t
        if t["passed_count"] == 0 and t["skipped_count"] and phases[name]["status"] == "passed":
            phases[name]["status"] = "all_skipped"
bench = {}
try:
    with open(os.path.join(out_dir, "bench.json")) as f:
        bench = json.load(f)
except (OSError, ValueError):
    pass
if bench and "summary" not in bench:  # the bench was cut short: summarize what it saved
    try:
        sys.path.insert(0, "scripts")
        import device_bench

        device_bench.RESULT.update(bench)
        device_bench.summarize()
        bench["summary"] = device_bench.RESULT["summary"] | {"partial": True}
    except Exception as e:  # noqa: BLE001
        bench["summary"] = {"partial": True, "summarize_error": repr(e)}
summary = {"mode": "cpu-smoke" if smoke == "1" else "device", "elapsed_s": int(time.time() - float(start)),
           "phases": phases, "bench": bench.get("summary", {}),
           "bench_errors": bench.get("errors", {}), "env": bench.get("env", {})}
summary["ok"] = all(p["status"] in ("passed", "skipped") for p in phases.values())
with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)

print("\n==================== device_check summary ====================")
print(f"mode {summary['mode']}, {summary['elapsed_s']} s, env {summary['env']}")
for name, p in phases.items():
    extra = ""
    if "tests" in p:
        t = p["tests"]
        extra = f"  tests: {t['passed_count']} passed, {t['failed_count']} failed, {t['skipped_count']} skipped"
        if t["failed"]:
            extra += f"; failed: {', '.join(t['failed'])}"
    print(f"  {name:13s} {p['status']:11s} rc {p['rc']:>3s} {p['seconds']:4d} s{extra}{'  ' + p['note'] if 'note' in p else ''}")
b = summary["bench"]
fmt = lambda k, spec: (format(b[k], spec) if isinstance(b.get(k), (int, float)) else str(b.get(k)))
print(f"  bench: tidal {fmt('tidal_output_tok_s', ',.0f')} output tok/s; floor {fmt('floor_output_tok_s', ',.0f')} tok/s "
      f"({fmt('floor_s', '.2f')} s); efficiency {fmt('efficiency', '.1%')} (bar 40%, goal 70%)")
print(f"         copy {fmt('bandwidth_TBps', '.2f')} TB/s, matmul {fmt('matmul_TFLOPs', '.0f')} TFLOP/s; "
      f"engine step {fmt('tidal_mean_step_ms', '.2f')} ms; forward-only batch-step eager "
      f"{fmt('forward_only_eager_ms', '.2f')} ms, graph {fmt('forward_only_graph_ms', '.2f')} ms, "
      f"floor {fmt('forward_only_floor_ms', '.2f')} ms")
print(f"         kernel time (forward-only over the workload) {fmt('kernel_time_s', '.2f')} s, engine overhead "
      f"{fmt('engine_overhead_share', '.1%')} of wall, kernel efficiency {fmt('kernel_efficiency', '.1%')}")
print(f"         transformers {fmt('hf_output_tok_s', ',.0f')} tok/s vs tidal {fmt('tidal_subset_output_tok_s', ',.0f')} "
      f"tok/s on the same seqs (x{fmt('ratio_tidal_over_hf_same_seqs', '.2f')}); bench errors: {summary['bench_errors'] or 'none'}")
print(f"summary: {os.path.join(out_dir, 'summary.json')}; ok={summary['ok']}")
EOF
rm -rf "$WORK"
exec 1>&- 2>&-
wait  # for tee to write the last lines
