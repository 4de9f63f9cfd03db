#!/usr/bin/env bash
# The GPU benchmarks in eight parts, each fitting one call of about ten minutes on a machine with one CUDA
# GPU; every step is bounded in time, and results land in $OUT as JSON with a markdown table beside it.
#   OUT=/tmp/out PART=latency bash benchmarks/run_gpu.sh
# docs/performance.md says what each part measures and which figures of the docs it reproduces.
#   tests       every gpu-marked test, in four workers sharing the GPU, with the failures and the 25 slowest
#   latency     the speed table: TPOT with CUDA graphs at 512 and 2K x batch 1, 16, 64; eager at batch 1;
#               async scheduling on and off at batch 1 and 16; the batch-1 decode-step profile
#   throughput  nano-vllm's throughput workload (async scheduling on and off), prefill MFU, mixed steps
#               (piecewise graphs against eager)
#   loops       early exit and kv_sharing against full (early_exit), self-speculative decoding (the tiny
#               model's acceptance, then TPOT at 0% and 100% forced, the speculative step and pipelined on
#               depth-batched passes), depth batching against lockstep early exit and full depth at 1, 16,
#               64 x 2K (64 rows fit only a card of more than 80 GB)
#   kv          TPOT of the KV formats in KV_FORMATS at 16 x 8K and 64 x 2K (pages of 64), the KVarN kernels
#   kernels     the kernels alone: skinny GEMM (cold L2) against cuBLAS, decode attention, fused elementwise
#               kernels, the norm epilogue by row count, deterministic mode's tiled GEMM against cuBLAS
#   ab          decode TPOT of version A (A=<commit-ish or directory>) against this tree, ABBA; EAGER=1 for
#               the eager path
#   profile     per-kernel profiles of decode steps: 1 x 512, 16 x 2K, 16 x 8K in PROFILE_KV's format, and
#               the host and device profile of an early-exit step
# LOOP_ENGINE_COMMIT=<hash> names the commit in the results where the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the directory for the results}"
: "${PART:?set PART to tests, latency, throughput, loops, kv, kernels, ab or profile}"
case " tests latency throughput loops kv kernels ab profile " in
  *" $PART "*) ;;
  *) echo "unknown PART=$PART: tests, latency, throughput, loops, kv, kernels, ab or profile" >&2; exit 2 ;;
esac
CK=/tmp/loop-engine-bench/ouro-1.4b
step() {  # step LIMIT_S COMMAND...: the command, killed after LIMIT_S seconds, and its output's last lines
  local limit=$1; shift
  echo "=== $* (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" 2>&1 | tail -n 40
}
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
mkdir -p "$OUT" /tmp/loop-engine-bench
# The random-weight checkpoint, written in the background; the parts that run the engine wait for it.
if [ "$PART" != tests ] && [ "$PART" != kernels ] && [ ! -d "$CK" ]; then
  ( python -m model.tiny --out /tmp/ck-1.4b --preset ouro-1.4b >/dev/null && mv /tmp/ck-1.4b "$CK" ) &
fi
case "$PART" in
tests)
  # four workers share the GPU (tests/gpu_share.py gives each a quarter of its memory): 150 tests in ~4 min
  timeout -k 10 "${TEST_LIMIT:-560}" python -m pytest -q -m gpu -n 4 --dist load -p tests.gpu_share tests/ \
    --timeout 300 -rfE --durations=25 \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 60
  ;;
latency)
  wait
  step 170 python -m benchmarks.latency --model "$CK" --prompts 512 2048 --batches 1 16 64 --modes graph \
    --out "$OUT/latency.json"
  step 90 python -m benchmarks.latency --model "$CK" --prompts 512 2048 --batches 1 --modes eager \
    --out "$OUT/latency-eager.json"
  step 120 python -m benchmarks.latency --model "$CK" --prompts 512 2048 --batches 1 16 --modes graph \
    --async-scheduling on off --out "$OUT/latency-async.json"
  step 60 python -m benchmarks.profile_decode --model "$CK" --batch 1 --prompt 512 \
    --out "$OUT/profile_decode-b1.json"
  ;;
throughput)
  wait
  step 230 python -m benchmarks.throughput --model "$CK" --async-scheduling on off \
    --out "$OUT/throughput.json"
  step 130 python -m benchmarks.prefill --model "$CK" --out "$OUT/prefill.json"
  step 180 python -m benchmarks.mixed_steps --model "$CK" --out "$OUT/mixed_steps.json"
  ;;
loops)
  wait
  step 130 python -m benchmarks.early_exit --model "$CK" --out "$OUT/early_exit.json"
  step 60 python -m benchmarks.speculative --acceptance --out "$OUT/speculative_acceptance.json"
  step 170 python -m benchmarks.speculative --model "$CK" \
    --acceptance-json "$OUT/speculative_acceptance.json" --out "$OUT/speculative.json"
  step 230 python -m benchmarks.depth_batching --model "$CK" --out "$OUT/depth_batching.json"
  ;;
kv)
  wait
  for shape in "8192 16" "2048 64"; do
    set -- $shape
    step 230 python -m benchmarks.latency --model "$CK" --modes graph --block-size 64 --decode-steps 16 \
      --kv-cache-dtypes ${KV_FORMATS:-bf16 fp8_e4m3 kvarn_k4v2_g64} --prompts "$1" --batches "$2" \
      --out "$OUT/latency-kv-$2x$1.json"
  done
  step 90 python -m benchmarks.kvarn_kernels --out "$OUT/kvarn_kernels.json"
  ;;
kernels)
  step 120 python -m benchmarks.gemv --ms 1,4,16 --budget 60 --out "$OUT/gemv.json"
  step 120 python -m benchmarks.attention --no-sweep --out "$OUT/attention.json"
  step 60 python -m benchmarks.fused_kernels --out "$OUT/fused_kernels.json"
  step 90 python -m benchmarks.epilogue_rows --out "$OUT/epilogue_rows.json"
  step 120 python -m benchmarks.invariant_gemm --out "$OUT/invariant_gemm.json"
  ;;
ab)
  wait
  for prompt in 512 2048; do
    step 270 python -m benchmarks.decode_ab --a "${A:?set A to a commit-ish or a directory}" \
      ${EAGER:+--eager} --batches 1 16 --prompt "$prompt" --model "$CK" --out "$OUT/decode_ab-$prompt.json"
  done
  ;;
profile)
  wait
  step 60 python -m benchmarks.profile_decode --model "$CK" --batch 1 --prompt 512 \
    --out "$OUT/profile_decode-b1.json"
  step 90 python -m benchmarks.profile_decode --model "$CK" --batch 16 --prompt 2048 \
    --out "$OUT/profile_decode-16x2k.json"
  step 150 python -m benchmarks.profile_decode --model "$CK" --batch 16 --prompt 8192 --steps 3 \
    --block-size 64 --kv-cache-dtype "${PROFILE_KV:-bf16}" --out "$OUT/profile_decode-16x8k.json"
  step 60 python -m benchmarks.profile_step --model "$CK" --policy early:0.5 --forced-exit 1
  ;;
esac
ls -la "$OUT"
