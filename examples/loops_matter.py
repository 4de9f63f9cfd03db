"""Held-out addition accuracy of a trained tiny Ouro at 1, 2, 3 and 4 loops, and under the exit gate.

    python -m examples.loops_matter [--model DIR] [--device cpu] [--items 512] [--out results.json]

Two measurements per row. "engine greedy" decodes each prompt "a+b=" with `Engine(loops=N)` and
compares the text up to the newline with the true sum. "teacher-forced" runs the model once over the
full line and checks every answer token's argmax; for exact match the two must agree. The gate rows
use HF's readout semantics (docs/ouro.md §4: every loop runs, each token reads out at the first loop whose
exit CDF reaches Q), and report how many loops the answer digits and plain story text would use.
The early:Q rows also run `Engine(exit_policy="early:Q")`, which stops a token's loops once its exit CDF
reaches Q and reports the loops it really ran per generated token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine import DEFAULT_MODEL, Engine, SamplingParams
from examples.train_tiny import LOOPS, score_items, story_exit_loops, test_pairs
from model.config import OuroConfig
from model.loader import load_model

QS = (0.5, 0.8, 0.95)
STORIES = 64


def engine_accuracy(model_dir: Path, device: str, pairs: list[tuple[int, int]], max_digits: int,
                    **engine_args) -> tuple[float, float | None]:
    """Greedy exact-match accuracy, and under early:Q the loops the engine really ran per generated token."""
    params = SamplingParams(temperature=0, max_tokens=max_digits + 2, stop=["\n"])
    prompts = [f"{a}+{b}=" for a, b in pairs]
    blocks = 4 * len(pairs)  # a sum and its answer fit in one 16-token block; 4x leaves room
    with Engine(model_dir, device=device, num_kv_blocks=blocks, verbose=False, **engine_args) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        loops_run = engine.loop_stats.loops_per_token if engine.exit_policy.can_exit else None
    accuracy = sum(out.outputs[0].text == str(a + b) for out, (a, b) in zip(outputs, pairs)) / len(pairs)
    return accuracy, loops_run


def engine_has_exit_policy(model_dir: Path, device: str) -> bool:
    try:
        Engine(model_dir, device=device, num_kv_blocks=1, verbose=False, exit_policy="early:0.5").close()
    except TypeError:
        return False
    return True


def evaluate(model_dir: str | Path | None = None, device: str = "cpu", items: int = 512,
             qs: tuple[float, ...] = QS) -> dict:
    model_dir = Path(model_dir) if model_dir is not None else DEFAULT_MODEL
    trained = json.loads((model_dir / "results.json").read_text())
    seed, max_digits = trained["seed"], trained["task"]["max_digits"]
    pairs = test_pairs(seed, items, max_digits)
    model = load_model(model_dir, OuroConfig.from_file(model_dir / "config.json"), torch.device(device),
                       torch.float32)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    scores = score_items(model, tokenizer, pairs, torch.device(device))
    rows = []
    for loops in range(1, LOOPS + 1):
        rows.append({"readout": f"loops={loops}", "loops": loops,
                     "engine_accuracy": engine_accuracy(model_dir, device, pairs, max_digits, loops=loops)[0],
                     "engine_loops_per_token": float(loops),
                     "teacher_forced_accuracy": scores.accuracy(loops),
                     "mean_loops_answer": float(loops), "mean_loops_story": float(loops)})
    exit_policy = engine_has_exit_policy(model_dir, device)
    for q in qs:
        accuracy, answer_loops = scores.q_exit(q)
        engine, loops_run = engine_accuracy(model_dir, device, pairs, max_digits, exit_policy=f"early:{q}") \
            if exit_policy else (None, None)
        rows.append({"readout": f"early:{q}", "q": q, "engine_accuracy": engine,
                     "engine_loops_per_token": loops_run,
                     "teacher_forced_accuracy": accuracy, "mean_loops_answer": answer_loops,
                     "mean_loops_story": story_exit_loops(model, tokenizer, seed, STORIES, q,
                                                          torch.device(device))})
    results = {"model": str(model_dir), "seed": seed, "task": trained["task"]["format"],
               "max_digits": max_digits, "items": items, "engine_exit_policy": exit_policy, "rows": rows}
    results["table_markdown"] = markdown_table(results)
    return results


def _cell(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(results: dict) -> str:
    lines = [f"Held-out addition ({results['items']} items, up to {results['max_digits']} digits, "
             f"seed {results['seed']}):", "",
             "| readout | engine greedy | engine loops per generated token | teacher-forced (HF Q-exit) "
             "| HF Q-exit loops, answer digits | HF Q-exit loops, story text |",
             "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['readout']} | {_cell(row['engine_accuracy'])} | "
                     f"{_cell(row['engine_loops_per_token'], 2)} | "
                     f"{_cell(row['teacher_forced_accuracy'])} | {_cell(row['mean_loops_answer'], 2)} | "
                     f"{_cell(row['mean_loops_story'], 2)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=512, help="held-out sums to score")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    results = evaluate(args.model, args.device, args.items)
    print(results["table_markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
