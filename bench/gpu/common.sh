# Sourced by the GPU machine's run scripts (bench/gpu/run_*.sh): the repository root as the
# working folder and on PYTHONPATH, NVLink multicast off, and `header` (the command, date and
# machine at the top of each results file). Sets repo and machine; defines header.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
machine="$(nvidia-smi -L 2>/dev/null | head -1) driver $(nvidia-smi --query-gpu=driver_version \
  --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores, kernel $(uname -r), \
$(python3 -V 2>&1), torch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
header() { printf '# command: %s\n# date: %s\n# machine: %s\n' "$1" "$(date -u +%FT%TZ)" "$machine"; }
