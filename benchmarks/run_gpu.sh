#!/usr/bin/env bash
# One device call: the gpu-marked tests, then the benchmarks, each bounded in time; JSON lands in $OUT.
#   LOOP_ENGINE_COMMIT=<hash> PART=a|b|c bash benchmarks/run_gpu.sh
#   a: gpu tests, gemv/attention/fused benchmarks, latency; b: gpu tests, attention sweep, throughput, early exit
#   c: the paired eval of CUDA graphs against eager (ABBA timing, token identity; docs/paired_eval.md)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}"
PART=${PART:-a}
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tail -n 40; }
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
mkdir -p /tmp/loop-engine-bench
( python -m model.tiny --out /tmp/ck-1.4b --preset ouro-1.4b >/dev/null && mv /tmp/ck-1.4b /tmp/loop-engine-bench/ouro-1.4b ) &
if [ "$PART" = a ]; then
  step 200 python -m pytest -q -m gpu tests/ --timeout 100
  step 90 python benchmarks/gemv.py --out "$OUT/gemv.json"
  step 80 python benchmarks/attention.py --no-sweep --out "$OUT/attention.json"
  step 50 python benchmarks/fused_kernels.py --out "$OUT/fused_kernels.json"
  wait
  step 170 python benchmarks/latency.py --preset ouro-1.4b --out "$OUT/latency.json"; cat "$OUT/latency.md"
elif [ "$PART" = c ]; then
  wait
  step 500 python engine.py eval --protocol benchmarks/tasks/decode_timing.json \
    --engine model=/tmp/loop-engine-bench/ouro-1.4b max_num_seqs=64 \
    --a enforce_eager=false --b enforce_eager=true --abba 2 --out "$OUT/paired-graphs_vs_eager.json"
else
  step 140 python -m pytest -q -m gpu tests/ --timeout 100
  step 110 python benchmarks/attention.py --out "$OUT/attention.json"
  wait
  step 160 python benchmarks/throughput.py --preset ouro-1.4b --out "$OUT/throughput.json"
  step 120 python benchmarks/early_exit.py --preset ouro-1.4b --out "$OUT/early_exit.json"
fi
ls -la "$OUT"
