"""Host time per decode step on CPU, with the network's loops stubbed out: what scheduling, preparing the
step's tensors, reading out, sampling, updating and building outputs cost, at 256 rows and at 512 and 4K
tokens of context. It must grow with rows, not with context.

    python -m benchmarks.host_overhead --out benchmarks/results/host_overhead.json
    python -m benchmarks.host_overhead --tree /path/to/an/older/checkout --label before --out ...

The stub replaces OuroForCausalLM.run_loop on this engine's model with the identity, so no attention or
projection runs and the KV pool is never written (its memory is never touched); embedding, lm_head on
the sampling rows and greedy sampling still run. The model is the tiny random preset with Ouro's 65536
positions. --tree imports the engine from another checkout of this
repository, so that the same measurement runs against an earlier commit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(engine, rows: int, context: int, steps: int, seed: int) -> float:
    """Mean host ms per decode step of `rows` rows whose prompts are `context` tokens long. Requests run
    until aborted, so that no row finishes while the later ones are still prefilling: every timed step
    decodes all `rows` rows."""
    from engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(3, engine.config.vocab_size) for _ in range(context)], params)
           for _ in range(rows)]
    produced = 0
    while produced < rows:  # prefill (stubbed loops) until every row has its first token
        produced += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)
    for _ in range(4):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        decoded = len(engine.step())
        if decoded != rows:
            raise RuntimeError(f"a timed step decoded {decoded} rows, not {rows}")
    elapsed = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return elapsed * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(ROOT),
                        help="the checkout whose engine to measure (default: this one)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=None, help="JSON to append this run's rows to")
    parser.add_argument("--in-tree", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = Path(args.tree).resolve()
    if tree != ROOT and not args.in_tree:
        # Another checkout: measure in a child whose engine is that tree's. -P keeps this script's directory
        # and the working directory off sys.path, so the engine comes from PYTHONPATH.
        command = [sys.executable, "-P", __file__, *sys.argv[1:], "--in-tree"]
        sys.exit(subprocess.run(command, env={**os.environ, "PYTHONPATH": str(tree)}).returncode)
    import torch

    from benchmarks.common import commit, environment
    from engine import Engine
    from model.tiny import write_checkpoint

    torch.set_num_threads(1)
    path = Path(write_checkpoint(Path(tempfile.mkdtemp()), preset="tiny", seed=0))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 65536  # Ouro's; the tiny preset's 4096 would cap a 4K context
    (path / "config.json").write_text(json.dumps(config))
    # The first rows decode while the last ones prefill (8192 tokens a step), then 4 + steps more.
    longest = max(args.contexts) + -(-args.rows * max(args.contexts) // 8192) + args.steps + 16
    blocks = args.rows * -(-longest // 16) + 16
    rows = []
    with Engine(path, device="cpu", dtype="float32", max_num_seqs=args.rows, max_num_batched_tokens=8192,
                max_model_len=longest, num_kv_blocks=blocks, enable_prefix_caching=False,
                verbose=False) as engine:
        engine.model.run_loop = lambda h, cos, sin, attention, t: h
        for context in args.contexts:
            ms = measure(engine, args.rows, context, args.steps, seed=context)
            rows.append({"label": args.label, "commit": commit(), "rows": args.rows, "context": context,
                         "host_ms_per_step": round(ms, 3), "us_per_row": round(ms * 1e3 / args.rows, 2)})
            print(rows[-1], flush=True)
    if args.out:
        out = Path(args.out)
        previous = json.loads(out.read_text()) if out.exists() else {"rows": []}
        payload = {**environment(), "device": "cpu (host work only; model loops stubbed)",
                   "rows": previous["rows"] + rows}
        out.write_text(json.dumps(payload, indent=2) + "\n")
        lines = ["| label | commit | rows | context | host ms / step | us / row |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['label']} | {r['commit']} | {r['rows']} | {r['context']} | "
                  f"{r['host_ms_per_step']} | {r['us_per_row']} |" for r in payload["rows"]]
        out.with_suffix(".md").write_text(
            f"Host time per decode step, loops stubbed, CPU, torch {payload['torch']}.\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
