#!/usr/bin/env bash
# Run chaosgpu's GPU faults on a GPU machine and keep every result.
#
#   bench/gpu/run_gpu_faults.sh OUT [STEP ...]      STEP: env tests catalog curves (default: all)
#
# Needs chaosgpu importable (PYTHONPATH=<checkout> is set here), torch with CUDA, nvidia-ml-py,
# and for `catalog` chaostoolkit importable. Writes OUT/results/ (one file per step, each with
# the command, date and machine at its top) and, after every step, OUT/results.tar.gz.
set -u
out=${1:?usage: run_gpu_faults.sh OUT [env|tests|catalog|curves ...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests catalog curves)
. "$(dirname "$0")/common.sh"
results="$out/results"
mkdir -p "$results/recorded" "$results/catalog"
pack() { tar czf "$out/results.tar.gz" -C "$out" results; }

for step in "${steps[@]}"; do
  echo "== step $step $(date -u +%FT%TZ)"
  case "$step" in
  env)
    {
      header "bench/gpu/run_gpu_faults.sh OUT env"
      nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv
      gcc --version 2>&1 | head -1
      python3 -c 'from chaosgpu.gpu import cudainject as c; print("headers", c.include_dirs()); print("cupti", c.cupti_library()); print("built", c.build())' 2>&1
      python3 -c 'import chaostoolkit, chaoslib; print("chaostoolkit", chaostoolkit.__version__, "lib", chaoslib.__version__)' 2>&1
      echo "dmesg readable: $(dmesg 2>&1 | tail -1 | cut -c1-120)"
      ls /dev/nvidia* 2>&1 | tr '\n' ' '; echo
    } >"$results/env.txt" 2>&1
    cat "$results/env.txt"
    ;;
  tests)
    dmesg 2>/dev/null | grep -i -E 'xid|nvrm' | tail -20 >"$results/dmesg-before-tests.txt"
    {
      header "python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu_faults_gpu.py"
      CHAOSGPU_RECORD_DIR="$results/recorded" timeout 280 python3 -m pytest -m gpu -v -s \
        -p no:cacheprovider tests/test_gpu_faults_gpu.py 2>&1
      echo "exit code $?"
    } >"$results/gpu-tests.txt" 2>&1
    tail -25 "$results/gpu-tests.txt"
    { echo "# dmesg lines naming Xid/NVRM after the tests (empty: none, or the log is hidden)"
      dmesg 2>&1 | grep -i -E 'xid|nvrm' | tail -40; } >"$results/dmesg-after-tests.txt"
    ;;
  catalog)
    # CATALOG="name ..." runs only those experiments.
    for name in ${CATALOG:-gpu-rank-hang gpu-memory-pressure gpu-memory-pressure-oom-handler \
                gpu-compute-contention gpu-xid gpu-cuda-alloc-fault}; do
      vars=()
      case "$name" in
        gpu-compute-contention) vars=(--var contention_s:float=10) ;;
        # one GPU: NCCL refuses two ranks on it, so this measures the remediation under gloo
        gpu-rank-hang-nccl-timeout) vars=(--var backend:str=gloo --var pg_timeout_s:float=10
                                          --var settle_timeout_s:float=25) ;;
      esac
      {
        header "chaos --no-version-check run ${vars[*]} experiments/$name.json"
        start=$(date +%s%N)
        timeout 170 python3 -c 'import sys; from chaostoolkit.__main__ import cli; sys.argv[0] = "chaos"; sys.exit(cli())' \
          --no-version-check --log-file "$results/catalog/$name.log" run \
          --journal-path "$results/catalog/$name.journal.json" "${vars[@]}" \
          "experiments/$name.json" >/dev/null 2>&1
        echo "exit code $? after $(( ($(date +%s%N) - start) / 1000000 )) ms"
        python3 bench/gpu/summarize_journal.py "$results/catalog/$name.journal.json"
      } >"$results/catalog/$name.txt" 2>&1
      cat "$results/catalog/$name.txt"
      pack
    done
    { echo "# dmesg lines naming Xid/NVRM after the catalog"; dmesg 2>&1 | grep -i -E 'xid|nvrm' | tail -40; } \
      >"$results/dmesg-after-catalog.txt"
    ;;
  curves)
    {
      header "python3 bench/gpu/release_curve.py run results/release-curves.json --workers 1 10 100 --mib 256"
      timeout 400 python3 bench/gpu/release_curve.py run "$results/release-curves.json" \
        --workers 1 10 100 --mib 256 2>&1
      echo "exit code $?"
    } >"$results/release-curves.txt" 2>&1
    cat "$results/release-curves.txt"
    ;;
  esac
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$results/memory-after-steps.txt"
  echo "after $step: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | wc -l) GPU processes" \
    >>"$results/memory-after-steps.txt"
  pack
done
