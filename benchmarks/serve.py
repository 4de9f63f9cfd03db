"""`loop-engine serve` under concurrent streaming clients against Engine.generate on the same requests: output
tok/s of each (the server's held against generate's, target 0.9x) and the server's time to first token, p50
and p99. The requests: --num-requests prompts of --prompt-len random token ids, each generating --max-tokens
tokens greedily (ignore_eos). Engine.generate runs them in this process with max_num_seqs = --concurrency;
then the server runs as its own process (`python engine.py serve`, the same engine flags) and --concurrency
clients stream them from this one, each sending its next request when the last has ended (closed loop), so
both run at most --concurrency sequences at once. It also counts the requests whose text the server gave
exactly as generate did.

    python -m benchmarks.serve --preset ouro-1.4b --out benchmarks/results/serve-<date>.json
    python -m benchmarks.serve --preset tiny --device cpu --num-requests 16 --concurrency 4 \\
        --prompt-len 32 --max-tokens 16 --out /tmp/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import torch

from benchmarks.common import ROOT, checkpoint, environment, sync, write_results
from engine import Engine, SamplingParams

TARGET = 0.9  # the server's output tok/s over Engine.generate's that the issue asks for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or HF id (default: --preset's)")
    parser.add_argument("--preset", default="ouro-1.4b", help="random-weight checkpoint shape (model.tiny)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads, both sides (CPU only)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64, help="streaming clients at once")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"benchmarks/results/serve-{environment()['date']}.json")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = checkpoint(args.model, args.preset)
    rng = random.Random(args.seed)
    engine_flags = {"device": device, "dtype": args.dtype, "max_num_seqs": args.concurrency,
                    "max_model_len": args.prompt_len + args.max_tokens}
    with Engine(path, verbose=False, **engine_flags) as engine:
        vocab = engine.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        generate = run_generate(engine, prompts, args.max_tokens)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    served = asyncio.run(run_server(path, engine_flags, prompts, args))
    same = sum(a == b for a, b in zip(generate.pop("texts"), served.pop("texts")))
    served["same_text_as_generate"] = same
    served["ratio_to_generate"] = round(served["output_tok_s"] / generate["output_tok_s"], 3)
    env = environment()
    rows = [generate, served]
    table = (f"Serving, {path} ({args.dtype}) on {env['device']}, torch {env['torch']}, commit "
             f"{env['commit']}: {args.num_requests} requests of {args.prompt_len} prompt tokens and "
             f"{args.max_tokens} output tokens (greedy, ignore_eos), at most {args.concurrency} at once; the "
             f"server's text equals generate's for {same} of {args.num_requests}\n\n"
             "| path | output tok/s | TTFT p50 ms | TTFT p99 ms | s | held against | ratio (target 0.9) |\n"
             "|---|---|---|---|---|---|---|\n"
             f"| Engine.generate | {generate['output_tok_s']} | - | - | {generate['seconds']} | - | - |\n"
             f"| server, {args.concurrency} streaming clients | {served['output_tok_s']} | "
             f"{served['ttft_p50_ms']} | {served['ttft_p99_ms']} | {served['seconds']} | Engine.generate | "
             f"{served['ratio_to_generate']} |\n")
    print(table)
    write_results(args.out, {**env, "model": path, "workload": {
        "num_requests": args.num_requests, "concurrency": args.concurrency, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "seed": args.seed}, "engine": engine_flags, "target": TARGET,
        "rows": rows}, table)


def run_generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every request through one Engine.generate (after a short warm-up): output tok/s and the texts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    sync(engine.device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {"path": "Engine.generate", "output_tokens": tokens, "seconds": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1), "texts": [out.outputs[0].text for out in outputs]}


async def run_server(path: str, engine_flags: dict, prompts: list[list[int]],
                     args: argparse.Namespace) -> dict:
    """The server in its own process, `concurrency` closed-loop streaming clients here."""
    command = [sys.executable, "engine.py", "serve", "--model", path, "--port", "0", "--log-level", "warning",
               "--max-pending-requests", str(2 * args.concurrency)]
    for flag, value in engine_flags.items():
        command += [f"--{flag.replace('_', '-')}", str(value)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        url = listening_url(process)
        limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
            await asyncio.gather(*(stream(client, p[:8], 4) for p in prompts[:args.concurrency]))  # warm-up
            results: list[dict | None] = [None] * len(prompts)
            queue = list(range(len(prompts)))[::-1]

            async def worker() -> None:
                while queue:
                    index = queue.pop()
                    results[index] = await stream(client, prompts[index], args.max_tokens)

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - start
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    return {"path": f"server, {args.concurrency} streaming clients", "output_tokens": tokens,
            "seconds": round(elapsed, 2), "output_tok_s": round(tokens / elapsed, 1),
            "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 1),
            "ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 1), "texts": [r["text"] for r in results]}


def listening_url(process: subprocess.Popen) -> str:
    """The server's base URL, from the line `serve` prints once it listens (the engine is built by then)."""
    for line in process.stderr:
        if " on http://" in line:
            return line.split(" on ")[1].split("/v1")[0]
    raise RuntimeError(f"the server exited (status {process.wait()}) before it listened")


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: its text, generated tokens (from the usage chunk) and time to first token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, texts, tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"]:
                first = first or time.perf_counter()
                texts.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"text": "".join(texts), "tokens": tokens, "ttft": first - start}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank)."""
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


if __name__ == "__main__":
    main()
