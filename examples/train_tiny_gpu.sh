#!/usr/bin/env bash
# Train the embedded tiny Ouro on one GPU, twice at once with the same seed (the second run records how
# well a retrain reproduces the first), then score both with examples/loops_matter.py on the CPU.
#
#   OUT=/some/dir bash examples/train_tiny_gpu.sh   (from anywhere; SEED, BUDGET optional;
#                                                    PRESET=toy DEVICE=cpu rehearses the script on a CPU)
#
# $OUT/tiny-ouro/  the checkpoint to commit as model/checkpoints/tiny-ouro/: config.json, model.safetensors,
#                  tokenizer.json, tokenizer_config.json, generation_config.json, results.json (command,
#                  seed, loss curves, accuracy), loops_matter.json (the table)
# $OUT/rerun.json  the second run's results.json and loops_matter table; its weights stay in $RERUN
# About 5 minutes on one H200: BUDGET seconds of training (the LR schedule ends on time if the steps
# would not), plus start-up, evaluation and a few sample generations.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the output directory}"
SEED=${SEED:-0}
BUDGET=${BUDGET:-230}
PRESET=${PRESET:-full}
DEVICE=${DEVICE:-cuda}
RERUN=${RERUN:-/tmp/tiny-ouro-rerun}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; fi

train=(python -m examples.train_tiny --preset "$PRESET" --seed "$SEED" --device "$DEVICE" --time-budget "$BUDGET")
"${train[@]}" --out "$OUT/tiny-ouro" >"$LOGS/main.log" 2>&1 &
main=$!
"${train[@]}" --out "$RERUN" >"$LOGS/rerun.log" 2>&1 &
rerun=$!
tail -n +1 -f --pid="$main" "$LOGS/main.log"
status=0
wait "$main" || status=$?
wait "$rerun" || status=$?
echo "--- rerun, last lines:"
tail -n 3 "$LOGS/rerun.log"
if [ "$status" -ne 0 ]; then exit "$status"; fi

python -m examples.loops_matter --model "$OUT/tiny-ouro" --out "$OUT/tiny-ouro/loops_matter.json" \
    >"$LOGS/main_table.md" &
first=$!
python -m examples.loops_matter --model "$RERUN" --out "$LOGS/rerun_loops.json" >"$LOGS/rerun_table.md"
wait "$first"
echo "--- main run:"; cat "$LOGS/main_table.md"
echo "--- rerun:"; cat "$LOGS/rerun_table.md"
python - "$RERUN/results.json" "$LOGS/rerun_loops.json" "$OUT/rerun.json" "$OUT/tiny-ouro/results.json" <<'EOF'
import json, sys
train, table, out, main = (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
rerun = {"train": json.load(open(train)), "loops_matter": json.load(open(table))}
json.dump(rerun, open(out, "w"), indent=1)
first = json.load(open(main))["task"]["accuracy_by_loops"]
print("held-out accuracy by loops, main vs rerun:", first, rerun["train"]["task"]["accuracy_by_loops"])
EOF

for prompt in "A looped language model" "Once upon a time"; do
    python engine.py generate --model "$OUT/tiny-ouro" --device cpu --max-tokens 48 --prompt "$prompt" 2>/dev/null
done
python engine.py generate --model "$OUT/tiny-ouro" --device cpu --max-tokens 12 --prompt "4821+3907=" 2>/dev/null
python engine.py generate --model "$OUT/tiny-ouro" --device cpu --max-tokens 48 --chat "What is 123+456?" \
    2>/dev/null
ls -la "$OUT" "$OUT/tiny-ouro"
