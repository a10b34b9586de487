#!/usr/bin/env bash
# GPU readiness check: the smoke matrix with --device cuda, `kvqbench perf` on CUDA (CUDA-event
# timing, torch.cuda.max_memory_allocated per round trip, every method as a ratio to a device-to-device copy
# of the same tensor, i.e. to the memory bandwidth), then the long tier (`kvqbench run --long`).
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (default OUT_DIR: results/gpu_check)
#
# Exit status: 0 when every step passes; 2 (one line on stderr) when CUDA is not available; otherwise the
# failing step's status. Without a GPU it stops before running anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-results/gpu_check}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  ver=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not importable")
  echo "gpu_check: CUDA is not available (torch ${ver}); run this on a machine with an NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
mkdir -p "$OUT"
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"

echo "gpu_check: 1/3 smoke matrix on cuda (serial, so pytest-benchmark times exp4)"
start=$(date +%s)
timeout 600 "$PY" -m pytest tests/bench -m smoke --device cuda -p no:xdist -q --kvq-out "$OUT/smoke" \
  --benchmark-json "$OUT/smoke/benchmark_exp4.json"
echo "gpu_check: smoke took $(( $(date +%s) - start )) s"

echo "gpu_check: 2/3 kvqbench perf on cuda (CUDA events; ratios to clone = device-to-device copy)"
start=$(date +%s)
timeout 600 "$PY" -m kvqbench.cli perf --device cuda --threads default --tokens 1024,4096,16384 --repeats 11 \
  --json "$OUT/perf_cuda.json"
echo "gpu_check: perf took $(( $(date +%s) - start )) s; results in $OUT/"

echo "gpu_check: 3/3 long tier on cuda (exp6: long decode, free-running, passkey; SmolLM2)"
start=$(date +%s)
timeout 1800 "$PY" -m kvqbench.cli run --long --device cuda --kvq-out "$OUT/long"
echo "gpu_check: long tier took $(( $(date +%s) - start )) s; results in $OUT/long"
