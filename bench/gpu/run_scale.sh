#!/usr/bin/env bash
# Run the scale benches and the GPU tests of the observed verdicts and the agent on a GPU
# machine, and keep every result.
#
#   bench/gpu/run_scale.sh OUT [STEP ...]     STEP: env nvml census census-venv teardown
#                                             timeline tests (default: all but census-venv
#                                             and teardown)
#
# Needs chaosgpu importable (PYTHONPATH=<checkout> is set here), torch with CUDA, nvidia-ml-py,
# and py-spy on PATH or importable for the verdict tests. Keeps results/ (one file per step,
# each with the command, date and machine at its top) as OUT/results.tar.gz, packed after every
# step. census-venv measures the snapshot as a user installs it: chaosgpu installed from a wheel
# ($CHAOSGPU_WHEEL, else built here without build isolation) into a fresh virtual environment
# (no system site-packages: no .pth of the image runs at every start), pynvml copied from the
# system Python (the GPU machine has no network) and compiled; CENSUS_BENCH_ARGS replaces the
# census bench's arguments (default: --repeat 5).
set -u
out=${1:?usage: run_scale.sh OUT [env|nvml|census|census-venv|teardown|timeline|tests ...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env nvml census timeline tests)
. "$(dirname "$0")/common.sh"
work=$(mktemp -d)

# make_venv DIR WHEEL: a fresh virtual environment with chaosgpu from WHEEL (no index, no
# dependencies), pynvml copied from the system Python for trees that still import it, and
# its files compiled, as an installed wheel has them
make_venv() {
  python3 -m venv --without-pip "$1" &&
    python3 -m pip --python "$1/bin/python" install -q --no-index --no-deps "$2" &&
    cp "$(python3 -c 'import pynvml; print(pynvml.__file__)')" \
      "$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/" &&
    "$1/bin/python" -m compileall -q "$1/lib"
}
results="$work/results"
mkdir -p "$results" "$out"
pack() { tar czf "$out/results.tar.gz" -C "$work" results; }
# the NVML layer of the GPU faults (utilisation, samples, XID registration): the census's
# NVML calls, compared with pynvml's
NVML_LAYER_TEST=test_gpu_faults_gpu.py::test_nvml_layer_reads_utilization_samples_and_xid_registration

for step in "${steps[@]}"; do
  echo "== step $step $(date -u +%FT%TZ)"
  case "$step" in
  env)
    {
      header "bench/gpu/run_scale.sh OUT env"
      nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,persistence_mode \
        --format=csv
      python3 - <<'PY'
import time
t = time.perf_counter()
import pynvml
t1 = time.perf_counter()
pynvml.nvmlInit()
t2 = time.perf_counter()
print(f"import pynvml {1000 * (t1 - t):.1f} ms, nvmlInit {1000 * (t2 - t1):.1f} ms")
PY
      python3 -c 'import chaosgpu.node as n; print(n.nvml_snapshot(with_processes=False))'
      command -v py-spy || python3 -c 'import py_spy' 2>&1 | tail -1
    } >"$results/env.txt" 2>&1
    cat "$results/env.txt"
    ;;
  nvml)
    python3 bench/gpu/nvml_call_costs.py --steps 0 100 --calls 20 --settle-s 10 2>&1 | tail -40
    cp bench/results/nvml-calls-*.txt "$results/" 2>/dev/null
    ;;
  census)
    python3 bench/census_bench.py --repeat 5 --out "$results/census.txt" 2>&1 | tail -40
    ;;
  census-venv)
    wheel=${CHAOSGPU_WHEEL:-}
    if [ -z "$wheel" ]; then
      python3 -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" . &&
        wheel=$(ls "$work"/wheel/*.whl)
      rm -rf build ./*.egg-info
    fi
    other=()
    if [ -n "${CHAOSGPU_OTHER_WHEEL:-}" ]; then
      if make_venv "$work/venv-other" "$CHAOSGPU_OTHER_WHEEL"; then
        other=(--other-snapshot "$work/venv-other/bin/chaosgpu")
      else
        echo "census-venv: no virtual environment could be made from $CHAOSGPU_OTHER_WHEEL" \
          | tee "$results/census-venv.txt"
        pack
        continue
      fi
    fi
    if [ -z "$wheel" ] || ! make_venv "$work/venv" "$wheel"; then
      echo "census-venv: no virtual environment with chaosgpu could be made here" \
        | tee "$results/census-venv.txt"
    else
      # shellcheck disable=SC2086  # CENSUS_BENCH_ARGS: words for the bench (default --repeat 5)
      env -u PYTHONPATH "$work/venv/bin/python" bench/census_bench.py \
        ${CENSUS_BENCH_ARGS:---repeat 5} "${other[@]}" --out "$results/census-venv.txt" 2>&1 \
        | tail -40
    fi
    ;;
  teardown)
    # NVML while the driver tears down 100 CUDA contexts at once: the modes round 23 measured
    # (memory, memory+list) and those it could not (four readers, a second process, nvidia-smi)
    {
      header "python3 bench/gpu/nvml_teardown.py --no-write --modes memory memory+list memory-4threads memory+list-elsewhere smi"
      timeout 480 python3 bench/gpu/nvml_teardown.py --no-write --modes memory memory+list \
        memory-4threads memory+list-elsewhere smi 2>&1
    } >"$results/nvml-teardown.txt" 2>&1
    tail -40 "$results/nvml-teardown.txt"
    ;;
  timeline)
    python3 bench/timeline_bench.py --gpu-workers 100 --mib 256 --seconds 8 --rates 100 \
      --name timeline-gpu100 2>&1 | tail -30
    cp bench/results/timeline-gpu100-*.txt "$results/" 2>/dev/null
    ;;
  tests)
    if ! command -v py-spy >/dev/null && ! python3 -c 'import py_spy' 2>/dev/null; then
      # the verdict tests need ranks' stacks: without py-spy they wait minutes for a verdict
      # that must stay unknown (round 17 lost 7 minutes of GPU time so)
      echo "tests: py-spy is not on PATH here: carry its wheel (pip install --no-deps --target" \
        "DIR py_spy-*.whl; PATH=DIR/bin:\$PATH) and run again" | tee "$results/tests.txt"
      pack
      continue
    fi
    {
      header "cd tests && python3 -m pytest -v -m gpu test_gpu_census.py test_timeline.py test_verdicts_gpu.py test_agent_gpu.py $NVML_LAYER_TEST"
      (cd tests && CHAOSGPU_GPU_EVIDENCE="$results/evidence" timeout 420 python3 -m pytest -v \
        -m gpu test_gpu_census.py test_timeline.py test_verdicts_gpu.py test_agent_gpu.py \
        "$NVML_LAYER_TEST" --rootdir=.. -c ../pyproject.toml 2>&1)
    } >"$results/tests.txt" 2>&1
    tail -30 "$results/tests.txt"
    ;;
  *) echo "unknown step $step" >&2 ;;
  esac
  pack
done
