"""Where a whole decode step's wall time goes, host and device, under an exit policy: torch.profiler with
CPU and CUDA activities over timed steps, the ops with the most host time and the most device time.

    python -m benchmarks.profile_step --preset ouro-1.4b --policy early:0.5 --forced-exit 1 --batch 1

--mixed N adds N more prompts once the first rows decode, so the profiled steps mix their prefill chunks
with the decode rows (eager steps); --async-scheduling on|off picks the scheduling.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import checkpoint
from engine import Engine, SamplingParams
from exit_policy import force_exit_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--forced-exit", type=int, default=None, help="force every exit after this loop")
    parser.add_argument("--kv-sharing", default="none", choices=["none", "last"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--gaps", type=int, default=0, help="also list the N longest device idle gaps")
    parser.add_argument("--mixed", type=int, default=0, help="prompts added before the profiled steps")
    parser.add_argument("--async-scheduling", default="on", choices=["on", "off"])
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, bf16, fp8_e4m3 or a KVarN preset")
    parser.add_argument("--block-size", type=int, default=16, help="64 for the KVarN g64 presets")
    parser.add_argument("--enforce-eager", action="store_true", help="eager steps (no CUDA graphs)")
    parser.add_argument("--python-profile", action="store_true",
                        help="cProfile the timed steps instead (Python functions by own host time)")
    args = parser.parse_args()
    path = checkpoint(args.model, args.preset)
    with Engine(path, device="cuda", dtype="bfloat16", max_num_seqs=args.batch + args.mixed,
                exit_policy=args.policy, kv_sharing=args.kv_sharing, kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size, enforce_eager=args.enforce_eager,
                max_model_len=args.prompt + 4 * args.steps + 8, enable_prefix_caching=False,
                # None: on where it applies (not under early:Q)
                async_scheduling=None if args.async_scheduling == "on" else False,
                verbose=False) as engine:
        if args.forced_exit is not None:
            force_exit_loop(engine.model, args.forced_exit, float(args.policy.partition(":")[2]))
        params = SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(list(range(3, 3 + args.prompt)), params)
        for _ in range(args.steps):  # prefill, then warm decode steps
            engine.step()
        for _ in range(args.mixed):
            engine.add_request(list(range(5, 5 + args.prompt)), params)
        torch.cuda.synchronize()
        if args.python_profile:
            print_python_profile(engine, args.steps, args.top)
            return
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / args.steps
    events = prof.key_averages()
    print(f"{args.policy} forced {args.forced_exit} kv_sharing={args.kv_sharing} batch {args.batch} "
          f"mixed {args.mixed} async {args.async_scheduling}: "
          f"{wall:.3f} ms per step (profiled)")
    for title, key in (("host", "self_cpu_time_total"), ("device", "self_device_time_total")):
        print(f"-- top {args.top} by {title} time, µs per step (calls per step)")
        for event in sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:args.top]:
            print(f"{getattr(event, key, 0.0) / args.steps:9.1f}  {event.count / args.steps:6.1f}  "
                  f"{event.key[:90]}")
    if args.gaps:
        print_gaps(prof, args.steps, args.gaps)


def print_python_profile(engine: Engine, steps: int, top: int) -> None:
    """Host time of the steps by Python function (own time, then cumulative), from cProfile: where an eager
    step's launches spend the host's time."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"{(time.perf_counter() - start) * 1e3 / steps:.3f} ms per step (under cProfile)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def print_gaps(prof, steps: int, count: int) -> None:
    """Device idle time per step (the profiled span less the union of kernel and copy intervals), and the
    longest idle gaps with the device work on either side."""
    work = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0)
    gaps, reach, last = [], work[0][1], work[0][2]
    for begin, end, name in work[1:]:
        if begin > reach:
            gaps.append((begin - reach, last, name))
        if end > reach:
            reach, last = end, name
    idle = sum(g for g, _, _ in gaps)
    print(f"-- device idle between the first and last kernel: {idle / steps:.1f} µs per step; "
          f"longest {count} gaps (µs, after -> before)")
    for gap, before, after in sorted(gaps, reverse=True)[:count]:
        print(f"{gap:9.1f}  {before[:45]} -> {after[:45]}")


if __name__ == "__main__":
    main()
