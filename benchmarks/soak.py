"""Soak: thousands of random requests through a KV pool small enough to preempt often, on CPU.

Each request has a random prompt, max_tokens, stop strings and stop ids, sampling temperature and seed, and
now and then logprobs, prompt logprobs, a loop trace or its own exit policy; some are aborted midway. Requests
arrive as others finish, so the engine never drains. The run checks that every request finishes exactly once
with a reason its own parameters explain ("abort" only if aborted, "stop" only at a stop string, stop id or
EOS, "length" only at max_tokens or the context limit, never "error"), that every block is free at the end,
and records the resident memory after a quarter, half and all of the requests (500 / 1,000 / 2,000 by
default).

    python -m benchmarks.soak [--requests 2000] [--seed 0] [--model DIR] [--out benchmarks/results/...json]

tests/test_soak.py runs 300 of them on the random-weight test checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import platform
import random
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import commit, write_results
from engine import DEFAULT_MODEL, Engine, SamplingParams

STOP_STRINGS = ["e", " t", "a", ".", "\n", "in", "the"]
EXIT_POLICIES = ["threshold:0.5", "hf", "step:1", "weighted"]


@dataclasses.dataclass(slots=True)
class Spec:
    prompt: list[int]
    params: SamplingParams
    abort_after: int | None  # steps after its arrival, or None


def random_spec(rng: random.Random, vocab: int) -> Spec:
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    params = SamplingParams(
        temperature=temperature,
        top_p=rng.choice([1.0, 1.0, 0.9]),
        top_k=rng.choice([0, 0, 20]),
        seed=rng.randrange(2**32) if temperature and rng.random() < 0.7 else None,
        max_tokens=rng.randint(1, 40),
        stop=rng.sample(STOP_STRINGS, rng.randint(1, 2)) if rng.random() < 0.3 else None,
        stop_token_ids=[rng.randrange(3, vocab)] if rng.random() < 0.1 else None,
        ignore_eos=rng.random() < 0.5,
        include_stop_str_in_output=rng.random() < 0.2,
        logprobs=rng.randint(0, 3) if rng.random() < 0.1 else None,
        prompt_logprobs=rng.randint(0, 2) if rng.random() < 0.05 else None,
        loop_trace=rng.random() < 0.1,
        exit_policy=rng.choice(EXIT_POLICIES) if rng.random() < 0.1 else None,
    )
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 48))]
    return Spec(prompt, params, rng.randint(1, 20) if rng.random() < 0.1 else None)


def problem(spec: Spec, out, aborted: bool, eos: tuple[int, ...], max_model_len: int) -> str | None:
    """Why this finished output does not follow from its request's parameters, or None."""
    c, params = out.outputs[0], spec.params
    if c.finish_reason == "error" or c.error is not None:
        return f"error: {c.error}"
    if len(c.token_ids) > params.max_tokens:
        return f"{len(c.token_ids)} tokens past max_tokens {params.max_tokens}"
    if c.finish_reason == "abort":
        return None if aborted else "abort without an abort"
    if c.finish_reason == "length":
        full = len(spec.prompt) + len(c.token_ids) >= max_model_len
        return None if len(c.token_ids) == params.max_tokens or full else \
            f"length after {len(c.token_ids)} of {params.max_tokens} tokens"
    if c.finish_reason == "stop":
        last = c.token_ids[-1] if c.token_ids else None
        if isinstance(c.stop_reason, str):  # the text ends at its first occurrence
            at_end = c.text.endswith(c.stop_reason) if params.include_stop_str_in_output \
                else c.stop_reason not in c.text
            ok = c.stop_reason in params.stop and at_end
            return None if ok else f"stop string {c.stop_reason!r} misplaced"
        if c.stop_reason is not None:
            ok = c.stop_reason in params.stop_token_ids and last == c.stop_reason
            return None if ok else f"stop id {c.stop_reason} at token {last}"
        return None if last in eos and not params.ignore_eos else f"stop at token {last}, not EOS"
    return f"unknown finish_reason {c.finish_reason!r}"


def resident_mib() -> float:
    """The process's resident set now (/proc/self/status), or its peak where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def soak(requests: int = 2000, seed: int = 0, model: str | Path | None = None, in_flight: int = 32,
         num_kv_blocks: int = 48, max_num_batched_tokens: int = 256, admission: str = "greedy") -> dict:
    """admission: greedy by default, so that the small pool preempts often (what the soak exercises)."""
    rng = random.Random(seed)
    marks = sorted({max(1, requests // 4), max(1, requests // 2), requests})
    with Engine(model if model is not None else DEFAULT_MODEL, device="cpu", dtype="float32",
                num_kv_blocks=num_kv_blocks, block_size=16, max_num_seqs=in_flight,
                max_num_batched_tokens=max_num_batched_tokens, admission=admission, verbose=False) as engine:
        eos, vocab = engine.tokenizer.stop_token_ids, engine.config.vocab_size
        specs = [random_spec(rng, vocab) for _ in range(requests)]
        arrivals = collections.deque(enumerate(specs))
        running: dict[str, tuple[int, int]] = {}  # request id -> (spec index, steps since arrival)
        aborted: set[str] = set()
        finished: dict[str, str] = {}  # request id -> finish_reason
        problems: list[str] = []
        rss: dict[str, float] = {}
        steps = tokens = stop_strings = 0
        start = time.perf_counter()
        while arrivals or engine.has_unfinished():
            while arrivals and len(running) < in_flight:
                index, spec = arrivals.popleft()
                running[engine.add_request(spec.prompt, spec.params)] = (index, 0)
            for out in engine.step():
                if not out.finished:
                    continue
                if out.request_id in finished or out.request_id not in running:
                    problems.append(f"request {out.request_id} handed back finished twice")
                    continue
                index, _ = running.pop(out.request_id)
                reason = problem(specs[index], out, out.request_id in aborted, eos, engine.max_model_len)
                if reason is not None:
                    problems.append(f"request {out.request_id}: {reason}")
                finished[out.request_id] = out.outputs[0].finish_reason
                tokens += len(out.outputs[0].token_ids)
                stop_strings += isinstance(out.outputs[0].stop_reason, str)
                if len(finished) in marks:
                    rss[str(len(finished))] = round(resident_mib(), 1)
            steps += 1
            for request_id, (index, age) in list(running.items()):
                running[request_id] = (index, age + 1)
                if specs[index].abort_after == age + 1:
                    engine.abort(request_id)
                    aborted.add(request_id)
        elapsed = time.perf_counter() - start
        bm, scheduler = engine.block_manager, engine.scheduler
        leftovers = {"blocks_in_use": bm.num_blocks - bm.num_free_blocks,
                     "unfinished": len(running) + len(scheduler.waiting) + len(scheduler.running),
                     "runner_rows": len(engine.runner.block_tables.synced),
                     "generators": len(engine.runner.generators)}
        preemptions = engine.scheduler.num_preemptions
    counts = collections.Counter(finished.values())
    return {
        "environment": {"device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
                        "platform": platform.platform(), "threads": torch.get_num_threads(),
                        "commit": commit(), "date": datetime.date.today().isoformat()},
        "config": {"requests": requests, "seed": seed, "model": str(model or DEFAULT_MODEL.name),
                   "in_flight": in_flight, "num_kv_blocks": num_kv_blocks, "block_size": 16,
                   "max_num_batched_tokens": max_num_batched_tokens, "admission": admission},
        "finished_once": len(finished), "problems": problems[:20], "num_problems": len(problems),
        "by_reason": dict(sorted(counts.items())), "aborts_sent": len(aborted), "stop_strings": stop_strings,
        "preemptions": preemptions, "steps": steps, "generated_tokens": tokens,
        "seconds": round(elapsed, 1), "tokens_per_s": round(tokens / elapsed, 1), "rss_mib": rss,
        "leftovers": leftovers, "ok": not problems and len(finished) == requests
        and not any(leftovers.values()),
    }


def table(report: dict) -> str:
    n = report["config"]["requests"]
    rows = [("requests finished exactly once", report["finished_once"], n),
            ("finish reasons not explained by the request", report["num_problems"], 0),
            ("blocks still in use at the end", report["leftovers"]["blocks_in_use"], 0),
            ("requests, block-table rows, generators left", report["leftovers"]["unfinished"]
             + report["leftovers"]["runner_rows"] + report["leftovers"]["generators"], 0)]
    config, env = report["config"], report["environment"]
    lines = [f"Soak, {n} random requests on CPU ({config['model']}, {config['in_flight']} in flight, "
             f"{config['num_kv_blocks']} blocks of 16), torch {env['torch']}, commit {env['commit']}, "
             f"{env['date']}.", "", "| check | value | expected |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {want} |" for name, value, want in rows]
    lines += ["", "| resident memory after N finished requests | MiB |", "|---|---|"]
    lines += [f"| {mark} | {mib} |" for mark, mib in report["rss_mib"].items()]
    reasons = ", ".join(f"{k} {v}" for k, v in report["by_reason"].items())
    lines += ["", f"Finish reasons: {reasons}; {report['aborts_sent']} aborts sent, {report['stop_strings']} "
              f"stop strings hit, {report['preemptions']} preemptions, {report['steps']} steps, "
              f"{report['generated_tokens']} tokens in {report['seconds']} s "
              f"({report['tokens_per_s']} tok/s)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--in-flight", type=int, default=32, help="requests kept in the engine at once")
    parser.add_argument("--num-kv-blocks", type=int, default=48, help="KV pool size, in blocks of 16 tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--admission", default="greedy", choices=["greedy", "reserve"],
                        help="greedy (default here: the pool preempts often) or reserve (the engine's)")
    parser.add_argument("--out", default=None, help="results JSON (a .md table is written beside it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = soak(args.requests, args.seed, args.model, args.in_flight, args.num_kv_blocks,
                  admission=args.admission)
    print(table(report))
    out = args.out or (f"benchmarks/results/soak-{report['environment']['date']}-"
                       f"{report['environment']['commit']}.json")
    write_results(out, report, table(report))
    if not report["ok"]:
        sys.exit("soak: FAILED (see the problems above)")


if __name__ == "__main__":
    main()
