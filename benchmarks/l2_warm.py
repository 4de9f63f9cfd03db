"""Decode TPOT (CUDA graphs) with the attention kernel warming L2 for the weights read after it.

At batch 1 and a short context the decode attention waits on latency: it reads a few MB of K/V in several
microseconds while the memory could move tens of MB. The Triton backend can spend that time asking L2 for
the first bytes of the o_proj and gate_up weights that the next two kernels read (AttentionBackend.
warm_l2_after, the l2_warm_* tunables of attention/triton_backend.py). This benchmark times the decode step
per budget (l2_warm_bytes) and placement (before the kernel's wait, or after each program's keys), in one
engine per prompt length, re-capturing the decode graphs for each setting and running the settings in
rounds of alternating order, so drift and the growing context cancel.

    python -m benchmarks.l2_warm --preset ouro-1.4b --out benchmarks/results/l2_warm.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import (BATCHED_TOKENS, checkpoint, copy_bandwidth, environment, head_start,
                               prefill_until_first_tokens, write_results)
from engine import Engine, SamplingParams


def step_ms(engine: Engine, steps: int) -> float:
    """Mean device time of `steps` decode steps, by CUDA events (after 3 warm steps)."""
    for _ in range(3):
        engine.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--budgets-mb", type=int, nargs="+", default=[0, 8, 16, 32, 48])
    parser.add_argument("--late", choices=["off", "on", "both"], default="both",
                        help="placement: before the wait (off), after each program's keys (on), or both")
    parser.add_argument("--context", type=int, default=1 << 30, help="l2_warm_context for the sweep")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=f"benchmarks/results/l2_warm-{environment()['date']}.json")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    bandwidth = copy_bandwidth()
    places = {"off": [False], "on": [True], "both": [False, True]}[args.late]
    settings = [(mb, late) for mb in args.budgets_mb for late in (places if mb else places[:1])]
    rows = []
    for prompt in args.prompts:
        tokens = (args.rounds * len(settings) * (args.steps + 3)
                  + head_start(args.batch, prompt, BATCHED_TOKENS))
        with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=args.batch,
                    max_model_len=prompt + tokens + 16, max_num_batched_tokens=BATCHED_TOKENS,
                    enable_prefix_caching=False, piecewise_graph_tokens=0) as engine:
            params = SamplingParams(temperature=0, max_tokens=tokens + 8, ignore_eos=True)
            for _ in range(args.batch):
                engine.add_request(list(range(3, 3 + prompt)), params)
            prefill_until_first_tokens(engine, args.batch)
            backend, graphs = engine.backend, engine.runner.graphs
            backend.l2_warm_rows, backend.l2_warm_context = args.batch, args.context
            times: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
            for round_ in range(args.rounds):
                for mb, late in settings if round_ % 2 == 0 else reversed(settings):
                    backend.l2_warm_bytes, backend.l2_warm_late = mb << 20, late
                    torch.cuda.synchronize()  # no step in flight reads the graphs' buffers
                    graphs.capture_all()
                    times[mb, late].append(step_ms(engine, args.steps))
            base = statistics.median(times[settings[0]])
            for (mb, late), ms in times.items():
                tpot = statistics.median(ms)
                row = {"batch": args.batch, "prompt": prompt, "budget_mb": mb, "late": late,
                       "tpot_ms": round(tpot, 3), "runs_ms": [round(t, 3) for t in ms],
                       "vs_first": round(tpot / base, 3)}
                rows.append(row)
                print(row, flush=True)
    env = environment()
    lines = [f"L2 warming by the decode attention, {path} (bf16), batch {args.batch}, CUDA graphs, "
             f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; copy "
             f"bandwidth {bandwidth / 1e12:.2f} TB/s; {args.rounds} rounds of {args.steps} steps a setting",
             "", "| prompt | l2_warm_bytes | placement | TPOT ms (median) | runs | of the first setting |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        place = "after the keys" if r["late"] else "before the wait"
        lines.append(f"| {r['prompt']} | {r['budget_mb']} MB | {place if r['budget_mb'] else '-'} | "
                     f"{r['tpot_ms']} | {', '.join(map(str, r['runs_ms']))} | {r['vs_first']} |")
    write_results(args.out, {**env, "copy_bandwidth_bytes_per_s": bandwidth, "model": path,
                             "batch": args.batch, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
