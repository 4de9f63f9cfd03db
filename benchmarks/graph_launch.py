"""What a host round trip between captured loops costs: the per-loop decode graphs of one bucket replayed back
to back (the device never waits), each followed by a synchronize (the host reacts to every loop, as an
early-exit step does), and the host time of one replay call; beside the whole-step graph.

    python -m benchmarks.graph_launch --preset ouro-1.4b --batch 1
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from benchmarks.common import checkpoint
from engine import Engine, SamplingParams


def timed(run, repeats: int) -> float:
    """Mean ms of run() over repeats, after one warm-up call, ending with a synchronize."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


def graphs_of(path: str, batch: int, policy: str):
    engine = Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=batch, exit_policy=policy,
                    max_model_len=1024, enable_prefix_caching=False, verbose=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(list(range(3, 515)), params)
    for _ in range(4):
        engine.step()  # prefill, then decode steps: the graphs' buffers hold a real batch
    return engine, engine.runner.graphs


def host_call_us(replay, repeats: int) -> float:
    """Median host µs of one replay call, the device idle before each."""
    calls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        replay()
        calls.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(calls)[len(calls) // 2] * 1e6


def loop_graph_times(path: str, batch: int, repeats: int) -> dict:
    engine, graphs = graphs_of(path, batch, "early:0.5")
    with engine:
        loops = [graphs.graphs[graphs.bucket_for(batch), t] for t in range(graphs.loops)]

        def back_to_back():
            for graph in loops:
                graph.replay()

        def synced():
            for graph in loops:
                graph.replay()
                torch.cuda.synchronize()

        return {"loop_graphs_back_to_back_ms": timed(back_to_back, repeats),
                "loop_graphs_synced_ms": timed(synced, repeats),
                "one_loop_replay_call_host_us": host_call_us(loops[1].replay, repeats)}


def step_graph_times(path: str, batch: int, repeats: int) -> dict:
    engine, graphs = graphs_of(path, batch, "full")
    with engine:
        step = graphs.graphs[graphs.bucket_for(batch), -1]
        return {"step_graph_ms": timed(step.replay, repeats),
                "step_replay_call_host_us": host_call_us(step.replay, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    result = {"batch": args.batch, **loop_graph_times(path, args.batch, args.repeats)}
    gc.collect()
    torch.cuda.empty_cache()
    result.update(step_graph_times(path, args.batch, args.repeats))
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
