"""Host work of an eager decode step, apart from the GPU: the engine's step at batch 1 on the CPU with every
Triton launch replaced by a no-op (triton_runtime.launch.CompiledLaunch, through which the model's and the
attention backend's kernels all launch), so what is timed is Python, the plans' lookups and torch's dispatch
of the step's allocations and small ops. An eager step on CUDA costs this plus its launches (about 19 µs each
on the H200's host, docs/h200.md) and whatever the GPU does not hide. The lm_head product still runs, as a
real CPU matmul; its time is measured apart and left out of the host figure. benchmarks/host_overhead.py
measures the other side of a step (scheduling, sampling, outputs, with the loops themselves stubbed).

    python -m benchmarks.eager_host [--layers 24] [--steps 10] [--rounds 10] [--out FILE.json]

Runs on a CPU only (the Triton interpreter is switched on, and never entered). The figure depends on the
machine's single-thread speed: compare runs on one machine, and say which.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the backend then accepts CPU tensors

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import environment, write_results  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402
from model.tiny import write_checkpoint  # noqa: E402
from triton_runtime.launch import CompiledLaunch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="layers of the Ouro-1.4B shape (24: all)")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps a round")
    parser.add_argument("--rounds", type=int, default=10, help="rounds; the fastest is reported (this is a "
                        "shared CPU: the slower rounds measure the neighbours)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.is_available():
        raise SystemExit("eager_host runs on a CPU machine (it stubs the kernels it would launch)")
    CompiledLaunch.__call__ = lambda self, stream, launch_args: None  # every Triton launch: host work only
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(tmp, preset="ouro-1.4b", layers=args.layers, dtype=args.dtype)
        with Engine(checkpoint, device="cpu", dtype=args.dtype, attention="triton", enforce_eager=True,
                    num_kv_blocks=64, max_model_len=512, verbose=False) as engine:
            model = engine.model
            model.fused_kernels = True  # the CUDA configuration: the fused layer and its launches
            timers = {"lm_head": 0.0, "loops": 0.0}

            def timed(name, fn):
                def call(*call_args):
                    start = time.perf_counter()
                    out = fn(*call_args)
                    timers[name] += time.perf_counter() - start
                    return out
                return call

            model.compute_logits = timed("lm_head", model.compute_logits)
            model.run_loop = timed("loops", model.run_loop)
            budget = args.rounds * args.steps + 8
            if 12 + budget > 512:
                raise SystemExit(f"--rounds x --steps must stay below {512 - 20} (max_model_len 512)")
            engine.add_request([5] * 12, SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True))
            for _ in range(4):  # the prefill step and warm decode steps: plans built, caches filled
                engine.step()
            rounds = []
            for _ in range(args.rounds):
                timers.update(lm_head=0.0, loops=0.0)
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                step_ms = (time.perf_counter() - start) * 1e3 / args.steps
                rounds.append((step_ms - timers["lm_head"] * 1e3 / args.steps, step_ms,
                               timers["lm_head"] * 1e3 / args.steps, timers["loops"] * 1e3 / args.steps))
            layers = engine.config.num_hidden_layers * engine.config.total_ut_steps
    host_ms, step_ms, lm_head_ms, loops_ms = min(rounds)
    row = {"layers": args.layers, "dtype": args.dtype, "steps": args.steps, "rounds": args.rounds,
           "step_ms": round(step_ms, 3), "lm_head_cpu_ms": round(lm_head_ms, 3), "host_ms": round(host_ms, 3),
           "host_us_per_layer_application": round(host_ms * 1e3 / layers, 1),
           "layer_stack_us_per_layer_application": round(loops_ms * 1e3 / layers, 1)}
    print(row)
    if args.out:
        payload = {**environment(), "cpu_threads": torch.get_num_threads(), "rows": [row]}
        table = (f"Host work of an eager batch-1 decode step, launches stubbed, on {payload['device']} "
                 f"({payload['cpu_threads']} threads), commit {payload['commit']}\n\n"
                 "| layers | dtype | step ms | lm_head (CPU) ms | host ms | µs per layer application "
                 "| of which the layer stack |\n"
                 "|---|---|---|---|---|---|---|\n"
                 f"| {args.layers} | {args.dtype} | {row['step_ms']} | {row['lm_head_cpu_ms']} | "
                 f"{row['host_ms']} | {row['host_us_per_layer_application']} | "
                 f"{row['layer_stack_us_per_layer_application']} |")
        write_results(args.out, payload, table)


if __name__ == "__main__":
    main()
