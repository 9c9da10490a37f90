#!/usr/bin/env bash
# Run catalog experiments on a GPU machine at the field report's sizes and keep the journals.
#
#   bench/gpu/run_catalog.sh OUTPUT_DIR [EXPERIMENT ...]
#
# Needs chaostoolkit and chaosgpu importable (e.g. PYTHONPATH=<checkout>) and `chaos` on PATH.
# Sizes: a torch worker holding 1850 MiB shows ~2466 MiB in NVML on an H200 (the CUDA context
# adds ~610 MiB), the report's per-worker figure; grace period 30 s as in the report.
set -u
out=${1:?usage: run_catalog.sh OUTPUT_DIR [EXPERIMENT ...]}
shift
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/../.." && pwd)
date -u +"date %FT%TZ"; uname -r; nvidia-smi -L 2>/dev/null
experiments=("$@")
[ ${#experiments[@]} -gt 0 ] || experiments=(nccl-rank-kill pod-delete-ignore-sigterm \
  pod-delete-ignore-sigterm-10 pod-delete-sigterm-handler)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for name in "${experiments[@]}"; do
  vars=()
  case "$name" in
    pod-delete-*|non-root-*|driver-api-*) vars=(--var mib:int=1850 --var grace_s:float=30) ;;
    nccl-rank-kill|rank-freeze) vars=(--var mib:int=1850) ;;
    nccl-timeout-remediation) vars=(--var mib:int=1850 --var pg_timeout_s:float=15) ;;
  esac
  echo "== $name $(date -u +%FT%TZ) ${vars[*]}"
  start=$(date +%s%N)
  chaos --no-version-check --log-file "$out/$name.log" run --journal-path "$out/$name.journal.json" \
    "${vars[@]}" "$repo/experiments/$name.json" >/dev/null 2>&1
  echo "exit code $? after $(( ($(date +%s%N) - start) / 1000000 )) ms"
  python3 - "$out/$name.journal.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print("status", j.get("status"), "deviated", j.get("deviated"))
for entry in j.get("run", []) + j.get("rollbacks", []):
    out = entry.get("output")
    text = json.dumps(out)[:400] if out is not None else ""
    print(f"  {entry['activity']['name']}: {entry['status']} {text}")
print("  summary:", json.dumps((j.get("chaosgpu") or {}).get("summary"))[:600])
PY
done
nvidia-smi --query-gpu=memory.used --format=csv
