#!/usr/bin/env bash
# One device call: the gpu-marked tests, then the benchmarks, each bounded in time; JSON lands in $OUT.
#   LOOP_ENGINE_COMMIT=<hash> PART=a|b|c bash benchmarks/run_gpu.sh
#   a: gpu tests, gemv/attention/fused benchmarks, latency; b: gpu tests, attention sweep, throughput, early exit
#   loops: gpu tests, early exit and kv_sharing rows, and (with BASE=<an older checkout>) full-policy TPOT
#   of BASE vs this tree in ABBA order; ab: that comparison, then latency
#   throughput: the KV-format gpu tests, throughput (with its step timeline), then prefill MFU
#   piecewise: the piecewise-graph, engine and async gpu tests, mixed steps piecewise vs eager, throughput
#   kvarn: the KV-format and KVarN-kernel gpu tests (the Triton KVarN engine path), the KVarN kernels' timing,
#          then TPOT (CUDA graphs) of bf16 against kvarn_k4v2_g64 at 1 and 16 x 2K
#   c: the paired eval of CUDA graphs against eager (ABBA timing, token identity; docs/paired_eval.md);
#      EARLY=1 runs benchmarks/early_exit.py first, EVAL_LIMIT (default 500) bounds the eval
#   check: every gpu test (with their durations), then BASE vs this tree with decode_ab --profile
#   wave2: every gpu test but the KVarN ones, latency under CUDA graphs (1, 16, 64 x 512 and 2K) and eager (1 x
#          2K), the batch-1 decode profile, the skinny GEMM with a cold L2
#   wave2kv: the KV-format and KVarN gpu tests, the KVarN kernels' timing (decode and prefill), TPOT of bf16
#          against kvarn_k4v2_g64 at 16 x 8K, the batch-1 profiles (KVarN, bf16), eager TPOT at 1 x 2K
#   wave2kl: the KVarN presets' KL at the Ouro-1.4B shape, 64 sink + 64 tail first, then none
#   wave3kv: TPOT (CUDA graphs) of fp8_e4m3, kvarn_k4v4_g64, kvarn_k5v5_g64, then bf16 (the same run's
#            baseline), at 16 x 8K, then 64 x 2K (issue 13's per-format TPOT; k4v2 is in
#            latency-kvarn-*-2026-12-03-bfdee90)
#   fp8: the fp8 tests (on CUDA), then fp8 decode attention at 1 x 512, 64 x 2K and 16 x 8K with the tunables sweep
#   fp8tpot: TPOT (CUDA graphs) of fp8_e4m3 at 16 x 8K and 64 x 2K, then the decode-step profiles of fp8 and bf16 at
#            16 x 8K
#   k5v5: the k5v5 and k4v4 decode kernels' timing (the engine's call and the one-basis one), TPOT (CUDA
#         graphs) of kvarn_k5v5_g64 against bf16 at 16 x 8K and 64 x 2K, the k5v5 kernel and KVarN engine gpu
#         tests, then the decode-step profile of kvarn_k5v5_g64 at 16 x 8K
#   g128: the g128 presets' decode kernels (the engine's call, GB/s) at 16 x 8K and 64 x 2K, then TPOT (CUDA graphs,
#         pages of 128) of kvarn_k4v2_g128, kvarn_k4v4_g128 and bf16 at 64 x 2K (16 x 8K: latency-kvarn-g128-16x8k-
#         2026-12-03-fb36f2b)
#   normkernel: the fused-model and epilogue gpu tests, then decode TPOT (CUDA graphs, 1 and 16 x 2K, ABBA) of
#               the norm epilogue at 2-16 rows (a copy of this tree with MAX_NORM_EPILOGUE_M = 16) against this
#               tree's norm kernel, then the 16 x 2K decode profile
#   preload: the skinny GEMM gpu tests, then decode TPOT (CUDA graphs, 1 x 512 and 1 x 2K, ABBA) of one-row
#            projections that load their whole weight slice before the PDL wait (qkv, o, gate_up) against the
#            streamed configs (a copy of this tree with the one-row configs of 2026-12-03), then the batch-1
#            decode profile
#   trigger: the one-row preload with the next kernel let launch before the weight loads instead of after the
#            wait (a copy of this tree; about 95 registers a thread instead of about 150, docs/h200.md): its
#            skinny GEMM gpu tests, then decode TPOT (CUDA graphs, ABBA) against this tree at 1 x 512 and 1 x 2K
#   eagerkeys: the fused-model and epilogue gpu tests, then eager decode TPOT (ABBA, 1 x 512 and 1 x 2K) of this
#              tree against a copy with ad22ccc's model/ (before the layers kept their weight keys, 7321d6d,
#              and the fused loop stopped slicing its ModuleList, 1ce694d); needs eager-keys.patch in the tree
#              root, made before the call: git diff ad22ccc HEAD -- model > eager-keys.patch
#   noattn: what the decode attention costs a step: TPOT (CUDA graphs, ABBA, 1 x 512, 1 x 2K, 16 x 2K) of this tree
#           against a copy whose decode kernel does nothing after its PDL wait (wrong tokens, timing only)
#   pointers: host µs a launch by how pointers reach Triton's launcher (benchmarks/launch_cost.py), eager decode
#             TPOT (ABBA, 1 x 512 and 1 x 2K) of this tree against a copy whose CompiledLaunch hands Triton the
#             tensors (as before eafc711; since b4cd2b3 both sides take the C launch on Triton 3.6), then the
#             launch, GEMM, fused-kernel and attention gpu tests
#   whatif: what parts of the o and down kernels cost a batch-1 step: TPOT (CUDA graphs, ABBA, 1 x 512) of this
#           tree against copies whose add-norms epilogue skips its norm tail, or whose o (K = 2,048) or down
#           (K = 5,632) projection reads 16 (o) or 512 (down) columns of its weight (wrong tokens, timing only)
#   arena: the epilogue-buffer gpu tests (fused model, epilogues, engine, piecewise graphs), eager TPOT (ABBA, 1 x
#          512 and 1 x 2K) of this tree against a copy without EpilogueBuffers, then that copy's C launch against
#          compiled.run (C_LAUNCH_VERSIONS = ()); needs arena.patch in the tree root, made before the call:
#          git diff e7920aa 63e01e7 > arena.patch
#   persistent: the batch-1 projection chain as one launch a product against one persistent kernel with grid
#               barriers (benchmarks/persistent_chain.py), then the gpu tests in TESTS (the engine and
#               piecewise-graph ones by default) for TEST_LIMIT s
#   shortkeys: decode attention (graph mode) at 1, 16, 64 x 512 and 1, 16 x 1K with the short class's splits of
#              128 keys (main) and SHORT_KEYS keys, then decode TPOT (CUDA graphs, ABBA) of this tree against a
#              copy with SHORT_KEYS at 1, 16 and 64 x 512
#   gputests: every gpu test, nothing else (one call's whole time), with failures and the slowest 25 listed
#   kv: the gpu tests (for TEST_LIMIT s, 280 by default: too short for all of them, PART=check runs them
#       all), the KV-format tests, decode attention and TPOT of bf16 against fp8_e4m3 at 64 x 2K and 16 x 8K,
#       the KVarN kernels, then (KVFORMATS=1) the low-bit formats' KL at the Ouro-1.4B shape
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
  step 90 python -m benchmarks.gemv --out "$OUT/gemv.json"
  step 80 python -m benchmarks.attention --no-sweep --out "$OUT/attention.json"
  step 50 python -m benchmarks.fused_kernels --out "$OUT/fused_kernels.json"
  wait
  step 170 python -m benchmarks.latency --preset ouro-1.4b --out "$OUT/latency.json"; cat "$OUT/latency.md"
elif [ "$PART" = loops ]; then
  timeout 230 python -m pytest -q -m gpu tests/ --timeout 120 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  wait
  step 130 python -m benchmarks.early_exit --preset ouro-1.4b --out "$OUT/early_exit.json"
  [ -n "${BASE:-}" ] && step 200 python -m benchmarks.decode_ab --a "$BASE" --b . --profile 16 --out "$OUT/decode_ab.json"
elif [ "$PART" = profile ]; then
  timeout 235 python -m pytest -q -m gpu tests/ --timeout 120 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  step 45 python -m benchmarks.profile_step --policy early:0.5 --forced-exit 1
  step 40 python -m benchmarks.profile_step --policy full
  step 115 python -m benchmarks.early_exit --preset ouro-1.4b --out "$OUT/early_exit.json"
  [ -n "${BASE:-}" ] && step 100 python -m benchmarks.decode_ab --a "$BASE" --b . --out "$OUT/decode_ab.json"
elif [ "$PART" = final ]; then
  timeout 170 python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_triton_gpu.py tests/test_loop_controls.py \
    --timeout 120 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  step 100 python -m benchmarks.early_exit --preset ouro-1.4b --out "$OUT/early_exit.json"
  step 110 python -m benchmarks.decode_ab --a "${BASE:?set BASE}" --b . --out "$OUT/decode_ab.json"
elif [ "$PART" = ab ]; then
  wait
  step 330 python -m benchmarks.decode_ab --a "${BASE:?set BASE}" --b . --out "$OUT/decode_ab.json"
  step 200 python -m benchmarks.latency --preset ouro-1.4b --prompts 512 2048 --batches 1 16 64 --modes graph \
    --out "$OUT/latency.json"
elif [ "$PART" = check ]; then
  timeout 430 python -m pytest -q -m gpu tests/ --timeout 120 -rfE --durations=15 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -n 40
  wait
  step 150 python -m benchmarks.decode_ab --a "${BASE:?set BASE}" --b . --profile 16 --out "$OUT/decode_ab.json"
elif [ "$PART" = wave2 ]; then
  # -k matches module names too: "not kvarn" leaves out test_kvarn*.py as well as the KVarN tests elsewhere
  timeout "${TEST_LIMIT:-230}" python -m pytest -q -m gpu tests/ -k "not kvarn" --timeout 120 -rfE \
    --durations=10 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
  pkill -f pytest  # what a cut-short test left running must not share the GPU with the timings
  wait
  step 150 python -m benchmarks.latency --preset ouro-1.4b --prompts 512 2048 --batches 1 16 64 --modes graph \
    --out "$OUT/latency.json"
  step 50 python -m benchmarks.latency --preset ouro-1.4b --prompts 2048 --batches 1 --modes eager \
    --out "$OUT/latency-eager.json"
  step 45 python -m benchmarks.profile_decode --out "$OUT/profile_decode.json"
  step 100 python -m benchmarks.gemv --ms 1,4,16 --budget 60 --out "$OUT/gemv.json"
elif [ "$PART" = wave2kv ]; then
  timeout "${TEST_LIMIT:-170}" python -m pytest -q -m gpu tests/test_kv_cache_dtype.py tests/test_kvarn_kernels.py \
    tests/test_kvarn_graph_step.py tests/test_kvarn.py --timeout 150 -rfE --durations=10 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 15
  pkill -f pytest  # what a cut-short test left running must not share the GPU with the timings
  step 70 python -m benchmarks.kvarn_kernels --out "$OUT/kvarn_kernels.json"
  wait
  step 150 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 64 \
    --kv-cache-dtypes auto kvarn_k4v2_g64 --prompts 8192 --batches 16 --decode-steps 16 \
    --out "$OUT/latency-kvarn.json"
  step 45 python -m benchmarks.profile_decode --kv-cache-dtype kvarn_k4v2_g64 --block-size 64 \
    --out "$OUT/profile_decode-kvarn.json"
  step 45 python -m benchmarks.profile_decode --out "$OUT/profile_decode.json"
  step 50 python -m benchmarks.latency --preset ouro-1.4b --prompts 2048 --batches 1 --modes eager \
    --out "$OUT/latency-eager.json"
elif [ "$PART" = wave3kv ]; then
  wait
  for shape in "8192 16" "2048 64"; do
    set -- $shape
    step 280 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 64 \
      --kv-cache-dtypes fp8_e4m3 kvarn_k4v4_g64 kvarn_k5v5_g64 bf16 --prompts "$1" --batches "$2" --decode-steps 16 \
      --out "$OUT/latency-kv-$2x$1.json"
  done
elif [ "$PART" = fp8 ]; then
  step 130 python -m pytest -q tests/test_kv_cache_dtype.py tests/test_gpu_engine.py -k fp8 --timeout 120 -rfE
  step 300 python -m benchmarks.attention --kv-cache-dtype fp8_e4m3 --shapes 1x512 64x2048 16x8192 \
    --out "$OUT/attention-fp8.json"
elif [ "$PART" = fp8tpot ]; then
  wait
  step 150 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 64 \
    --kv-cache-dtypes fp8_e4m3 --prompts 8192 2048 --batches 16 64 --decode-steps 16 --out "$OUT/latency-fp8.json"
  for kv in fp8_e4m3 bf16; do
    step 100 python -m benchmarks.profile_decode --model /tmp/loop-engine-bench/ouro-1.4b --batch 16 \
      --prompt 8192 --steps 3 --kv-cache-dtype $kv --block-size 64 --out "$OUT/profile-16x8k-$kv.json"
  done
elif [ "$PART" = k5v5 ]; then
  step 150 python -m benchmarks.kvarn_kernels --decode-only --no-dense --formats kvarn_k5v5_g64,kvarn_k4v4_g64 \
    --out "$OUT/kvarn_kernels.json"
  wait
  for shape in "8192 16" "2048 64"; do
    set -- $shape
    step 150 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 64 \
      --kv-cache-dtypes kvarn_k5v5_g64 bf16 --prompts "$1" --batches "$2" --decode-steps 16 \
      --out "$OUT/latency-k5v5-$2x$1.json"
  done
  timeout 200 python -m pytest -q -m gpu tests/test_kvarn_kernels.py tests/test_kv_cache_dtype.py -k "k5v5 or engine" \
    --timeout 150 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  step 100 python -m benchmarks.profile_decode --model /tmp/loop-engine-bench/ouro-1.4b --batch 16 \
    --prompt 8192 --steps 3 --kv-cache-dtype kvarn_k5v5_g64 --block-size 64 --out "$OUT/profile-16x8k-k5v5.json"
elif [ "$PART" = g128 ]; then
  step 400 python -m benchmarks.kvarn_kernels --decode-only --no-dense --formats kvarn_k4v2_g128,kvarn_k4v4_g128 \
    --out "$OUT/kvarn_kernels-g128.json"
  wait
  step 250 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 128 \
    --kv-cache-dtypes kvarn_k4v2_g128 kvarn_k4v4_g128 bf16 --prompts 2048 --batches 64 --decode-steps 16 \
    --out "$OUT/latency-g128-64x2k.json"
elif [ "$PART" = normkernel ]; then
  timeout 150 python -m pytest -q -m gpu tests/test_fused_model.py tests/test_gemv_epilogues.py --timeout 100 -rfE \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  rm -rf /tmp/epilogue-norms && cp -r . /tmp/epilogue-norms
  sed -i 's/^MAX_NORM_EPILOGUE_M = 1$/MAX_NORM_EPILOGUE_M = 16/' /tmp/epilogue-norms/model/kernels/gemv_epilogues.py
  step 400 python -m benchmarks.decode_ab --a /tmp/epilogue-norms --b . --labels norm-epilogue norm-kernel \
    --batches 1 16 --prompt 2048 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-norm-kernel.json"
  step 120 python -m benchmarks.profile_decode --batch 16 --prompt 2048 --out "$OUT/profile_decode-16x2k.json"
elif [ "$PART" = preload ]; then
  timeout 150 python -m pytest -q -m gpu tests/test_gemv.py tests/test_gemv_epilogues.py tests/test_fused_model.py \
    --timeout 100 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  rm -rf /tmp/streamed && cp -r . /tmp/streamed
  sed -i -e 's/GemvConfig(8, 512, 1, 4, 3, False, preload=True)/GemvConfig(16, 512, 1, 4, 3, False)/' \
    -e 's/GemvConfig(8, 512, 1, 4, 4, False, preload=True)/GemvConfig(8, 512, 1, 4, 4, False)/' \
    /tmp/streamed/model/kernels/gemv.py
  echo "preload configs left in the streamed copy: $(grep -c 'preload=True)' /tmp/streamed/model/kernels/gemv.py)"
  for prompt in 512 2048; do
    step 220 python -m benchmarks.decode_ab --a /tmp/streamed --b . --labels streamed preload --batches 1 \
      --prompt "$prompt" --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-preload-$prompt.json"
  done
  step 100 python -m benchmarks.profile_decode --batch 1 --prompt 512 --out "$OUT/profile_decode-b1.json"
elif [ "$PART" = trigger ]; then
  wait
  rm -rf /tmp/trigger-first && cp -r . /tmp/trigger-first
  sed -i -e 's/^    if PRELOAD_K:$/    if PRELOAD_K:\n        launch_dependents(PDL)/' \
    -e '/^        wait_for_previous(PDL)$/{n;/^        launch_dependents(PDL)$/d}' /tmp/trigger-first/model/kernels/gemv.py
  echo "trigger-first copy: $(grep -c 'launch_dependents(PDL)' /tmp/trigger-first/model/kernels/gemv.py) triggers (2 expected)"
  sed -n '/^    if PRELOAD_K:$/,/^        return/p' /tmp/trigger-first/model/kernels/gemv.py
  (cd /tmp/trigger-first && timeout 120 python -m pytest -q -m gpu tests/test_gemv.py tests/test_gemv_epilogues.py \
    --timeout 100 -rfE 2>&1 | tail -n 5)
  for prompt in 512 2048; do
    step 220 python -m benchmarks.decode_ab --a . --b /tmp/trigger-first --labels trigger-after trigger-first \
      --batches 1 --prompt "$prompt" --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-trigger-$prompt.json"
  done
elif [ "$PART" = eagerkeys ]; then
  timeout 150 python -m pytest -q -m gpu tests/test_gemv_epilogues.py tests/test_fused_model.py --timeout 100 -rfE \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  rm -rf /tmp/keys-every-call && cp -r . /tmp/keys-every-call
  (cd /tmp/keys-every-call && patch -R -p1 < eager-keys.patch) || exit 1
  for prompt in 512 2048; do
    step 250 python -m benchmarks.decode_ab --eager --a /tmp/keys-every-call --b . \
      --labels keys-every-call weight-keys-kept --batches 1 --prompt "$prompt" \
      --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-eager-keys-$prompt.json"
  done
elif [ "$PART" = noattn ]; then
  wait
  rm -rf /tmp/no-attention && cp -r . /tmp/no-attention
  sed -i 's/^    if split < num_splits:$/    if (split < num_splits) \& (split < 0):  # timing only/' \
    /tmp/no-attention/attention/kernels/decode.py
  echo "stubbed: $(grep -c '# timing only' /tmp/no-attention/attention/kernels/decode.py) (1 expected)"
  step 200 python -m benchmarks.decode_ab --a . --b /tmp/no-attention --labels attention no-attention \
    --batches 1 16 --prompt 2048 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-noattn-2048.json"
  step 150 python -m benchmarks.decode_ab --a . --b /tmp/no-attention --labels attention no-attention \
    --batches 1 --prompt 512 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-noattn-512.json"
elif [ "$PART" = pointers ]; then
  step 90 python -m benchmarks.launch_cost --out "$OUT/launch_cost.json"
  wait
  rm -rf /tmp/tensors-to-triton && cp -r . /tmp/tensors-to-triton
  sed -i 's/^            if self.pointers:$/            if False:  # timing only/' /tmp/tensors-to-triton/attention/launch.py
  echo "tensors-to-triton copy: $(grep -c '# timing only' /tmp/tensors-to-triton/attention/launch.py) (1 expected)"
  for prompt in 512 2048; do
    step 200 python -m benchmarks.decode_ab --eager --a /tmp/tensors-to-triton --b . \
      --labels tensors-to-triton addresses-as-ints --batches 1 --prompt "$prompt" \
      --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-eager-pointers-$prompt.json"
  done
  timeout "${TEST_LIMIT:-200}" python -m pytest -q -m gpu tests/test_launch.py tests/test_gemv.py \
    tests/test_gemv_epilogues.py tests/test_fused_model.py tests/test_fused_kernels.py tests/test_triton_gpu.py \
    --timeout 150 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
elif [ "$PART" = whatif ]; then
  wait
  E=model/kernels/gemv_epilogues.py
  stub() {  # a copy of this tree at /tmp/$1 with sed expression $2 applied to $E (timing only: wrong tokens)
    rm -rf "/tmp/$1" && cp -r . "/tmp/$1" && sed -i "$2" "/tmp/$1/$E"
    echo "$1: $(grep -c '# timing only' "/tmp/$1/$E") stubbed line (1 expected)"
  }
  stub no-norm-tail 's/^    if tl.atomic_add(tickets_ptr + _ROW_TICKET, 1, sem="acq_rel") == tl.num_programs(0) - 1:$/    if tl.atomic_add(tickets_ptr + _ROW_TICKET, 1, sem="acq_rel") == -5:  # timing only/'
  stub no-o-weights 's/^    offs_n = tl.program_id(0) \* BLOCK_N + tl.arange(0, BLOCK_N)$/    K = tl.where(K == 2048, 16, K)  # timing only\n&/'
  stub no-down-weights 's/^    offs_n = tl.program_id(0) \* BLOCK_N + tl.arange(0, BLOCK_N)$/    K = tl.where(K == 5632, 16, K)  # timing only\n&/'
  for variant in no-norm-tail no-o-weights no-down-weights; do
    step 150 python -m benchmarks.decode_ab --a . --b "/tmp/$variant" --labels main "$variant" --batches 1 \
      --prompt 512 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-whatif-$variant-512.json"
  done
elif [ "$PART" = arena ]; then
  timeout "${TEST_LIMIT:-230}" python -m pytest -q -m gpu tests/test_gemv_epilogues.py tests/test_fused_model.py \
    tests/test_gpu_engine.py tests/test_piecewise_graphs.py --timeout 150 -rfE 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -n 15
  pkill -f pytest  # what a cut-short test left running must not share the GPU with the timings
  wait
  rm -rf /tmp/no-arena && cp -r . /tmp/no-arena && (cd /tmp/no-arena && patch -s -R -p1 < arena.patch) || exit 1
  rm -rf /tmp/no-c-launch && cp -r /tmp/no-arena /tmp/no-c-launch
  sed -i 's/^C_LAUNCH_VERSIONS = .*/C_LAUNCH_VERSIONS = ()/' /tmp/no-c-launch/attention/launch.py
  for prompt in 512 2048; do
    step 140 python -m benchmarks.decode_ab --eager --a /tmp/no-arena --b . --labels main eager-arena --batches 1 \
      --prompt "$prompt" --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-eager-arena-$prompt.json"
  done
  step 120 python -m benchmarks.decode_ab --eager --a /tmp/no-c-launch --b /tmp/no-arena --labels compiled-run c-launch \
    --batches 1 --prompt 512 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-eager-c-launch-512.json"
elif [ "$PART" = shortkeys ]; then
  # The short class's split length: decode attention (graph mode) with 128-key short splits (main) and
  # SHORT_KEYS-key ones, then decode TPOT (CUDA graphs, ABBA) of this tree against a copy with SHORT_KEYS.
  step 150 python -m benchmarks.attention --shapes 1x512 16x512 64x512 1x1024 16x1024 \
    --out "$OUT/attention-shortkeys.json" --configs "[{}, {\"short_split_keys\": ${SHORT_KEYS:?set SHORT_KEYS}}, {}]"
  wait
  rm -rf /tmp/shortkeys && cp -r . /tmp/shortkeys
  sed -i "s/^        self.short_split_keys = 128$/        self.short_split_keys = ${SHORT_KEYS}/" \
    /tmp/shortkeys/attention/triton_backend.py
  echo "shortkeys copy: $(grep -c "self.short_split_keys = ${SHORT_KEYS}$" /tmp/shortkeys/attention/triton_backend.py) (1 expected)"
  step 330 python -m benchmarks.decode_ab --a . --b /tmp/shortkeys --labels short-128 "short-${SHORT_KEYS}" \
    --batches 1 16 64 --prompt 512 --model /tmp/loop-engine-bench/ouro-1.4b --out "$OUT/decode_ab-shortkeys-512.json"
elif [ "$PART" = persistent ]; then
  step 170 python -m benchmarks.persistent_chain --out "$OUT/persistent_chain.json"
  timeout "${TEST_LIMIT:-330}" python -m pytest -q -m gpu ${TESTS:-tests/test_gpu_engine.py tests/test_piecewise_graphs.py} \
    --timeout 150 -rfE --durations=10 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
elif [ "$PART" = gputests ]; then
  timeout "${TEST_LIMIT:-560}" python -m pytest -q -m gpu tests/ --timeout 150 -rfE --durations=25 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 60
elif [ "$PART" = wave2kl ]; then
  wait
  step "${KVFORMATS_LIMIT:-330}" python -m benchmarks.kv_formats --model /tmp/loop-engine-bench/ouro-1.4b \
    --device cuda --dtype bfloat16 --prompts 1 --prompt-len 512 --new-tokens 512 \
    --formats kvarn_k4v2_g64 kvarn_k5v5_g64 kvarn_k4v4_g64 --side-pools 64:64,0:0 --out "$OUT/kv_formats_ouro.json"
elif [ "$PART" = kv ]; then
  timeout "${TEST_LIMIT:-280}" python -m pytest -q -m gpu tests/ --timeout 120 -rfE 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -n 25
  timeout 100 python -m pytest -q tests/test_kv_cache_dtype.py tests/test_kvarn_kernels.py --timeout 60 -rfE 2>&1 \
    | tee "$OUT/kv_tests.log" | tail -n 15
  for kv in auto fp8_e4m3; do
    step 60 python -m benchmarks.attention --no-sweep --kv-cache-dtype "$kv" --shapes 1x512 64x2048 16x8192 \
      --out "$OUT/attention-$kv.json"
  done
  step 90 python -m benchmarks.kvarn_kernels --out "$OUT/kvarn_kernels.json"
  wait
  step 150 python -m benchmarks.latency --preset ouro-1.4b --prompts 2048 8192 --batches 1 16 64 --modes graph \
    --kv-cache-dtypes auto fp8_e4m3 --out "$OUT/latency.json"
  if [ -n "${KVFORMATS:-}" ]; then
    step "${KVFORMATS_LIMIT:-300}" python -m benchmarks.kv_formats --model /tmp/loop-engine-bench/ouro-1.4b \
      --device cuda --dtype bfloat16 --prompts 2 --prompt-len 512 --new-tokens 512 --out "$OUT/kv_formats_ouro.json"
  fi
elif [ "$PART" = throughput ]; then
  timeout 120 python -m pytest -q -m gpu tests/test_kv_cache_dtype.py ${TESTS:-} --timeout 100 -rfE 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  step 220 python -m benchmarks.throughput --preset ouro-1.4b ${THROUGHPUT_ARGS:-} --out "$OUT/throughput.json"
  step 150 python -m benchmarks.prefill --preset ouro-1.4b --out "$OUT/prefill.json"; cat "$OUT/prefill.md"
elif [ "$PART" = piecewise ]; then
  timeout "${TEST_LIMIT:-200}" python -m pytest -q -m gpu tests/test_piecewise_graphs.py tests/test_gpu_engine.py \
    tests/test_async_scheduling.py ${TESTS:-} --timeout 120 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  wait
  step 200 python -m benchmarks.mixed_steps --preset ouro-1.4b --out "$OUT/mixed_steps.json"
  step 230 python -m benchmarks.throughput --preset ouro-1.4b --async-scheduling on off --out "$OUT/throughput.json"
elif [ "$PART" = kvarn ]; then
  timeout "${TEST_LIMIT:-240}" python -m pytest -q -m gpu tests/test_kv_cache_dtype.py tests/test_kvarn_kernels.py \
    tests/test_kvarn_graph_step.py ${TESTS:-} --timeout 150 -rfE --durations=10 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -n 15
  step 90 python -m benchmarks.kvarn_kernels --out "$OUT/kvarn_kernels.json"
  wait
  step 300 python -m benchmarks.latency --preset ouro-1.4b --modes graph --block-size 64 \
    --kv-cache-dtypes auto kvarn_k4v2_g64 --prompts 2048 --batches 1 16 --decode-steps 16 \
    --out "$OUT/latency-kvarn.json"
elif [ "$PART" = c ]; then
  wait
  [ -n "${EARLY:-}" ] && step 120 python -m benchmarks.early_exit --preset ouro-1.4b --out "$OUT/early_exit.json"
  step "${EVAL_LIMIT:-500}" python engine.py eval --protocol benchmarks/tasks/decode_timing.json \
    --engine model=/tmp/loop-engine-bench/ouro-1.4b max_num_seqs=64 \
    --a enforce_eager=false --b enforce_eager=true --abba 2 --out "$OUT/paired-graphs_vs_eager.json"
else
  step 140 python -m pytest -q -m gpu tests/ --timeout 100
  step 110 python -m benchmarks.attention --out "$OUT/attention.json"
  wait
  step 160 python -m benchmarks.throughput --preset ouro-1.4b --out "$OUT/throughput.json"
  step 120 python -m benchmarks.early_exit --preset ouro-1.4b --out "$OUT/early_exit.json"
fi
ls -la "$OUT"
