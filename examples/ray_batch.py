"""Batch inference on Ray Data: prompts streamed from JSONL or Parquet through a pool of actors, each holding
one Engine, and the completions written back as JSONL or Parquet. Ray is an optional extra
(`pip install -e ".[ray]"`); the engine itself never imports it.

    python -m examples.ray_batch --input examples/prompts.jsonl --output out/ --device cpu \\
        --num-workers 2 --cpus-per-worker 0.5
    python -m examples.ray_batch --input prompts.parquet --output out/ --output-format parquet \\
        --model ByteDance/Ouro-1.4B --num-workers 8 --loops 3 --exit-policy early:0.5 --loop-trace

Run it from the repository root: Ray puts the driver's working directory on its workers' import path.

Input: one row per request with a `prompt` (a string); every other column (an `id`, say) is carried to the
request's output row unchanged. Rows come out in input order (the output files, sorted by name, hold them
in that order). Output columns:

    prompt, text, token_ids, finish_reason   as in the Engine's RequestOutput
    error                                    why the request failed (finish_reason "error"), else null
    loops, exit_policy                       the engine's loop count and exit policy
    mean_loops_run                           with --loop-trace: loops run per generated token (under
                                             early:Q the first token, sampled in the prefill, runs all)
    mean_readout_loops                       with --loop-trace: loops behind each token's readout (exit_loop
                                             + 1), averaged; null under "weighted", which mixes every loop

A request that fails (an empty prompt, a missing one) gets a row with finish_reason "error"; the others in
its batch finish as usual.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import SaveMode

from engine import Engine, RequestOutput, SamplingParams, engine_kwargs

OUTPUT_COLUMNS = ("prompt", "text", "token_ids", "finish_reason", "error", "loops", "exit_policy",
                  "mean_loops_run", "mean_readout_loops")
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
OWN_FLAGS = ("model", "device", "loops", "exit_policy", "dtype")  # Engine arguments that have a flag here


class EngineWorker:
    """One Engine per Ray actor; each call generates one batch of prompts."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], params: SamplingParams) -> None:
        self.engine = Engine(model, **{"verbose": False, **engine_kwargs})
        self.params = params
        self.loops = self.engine.loops
        self.exit_policy = params.exit_policy or str(self.engine.exit_policy)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        prompts = list(batch["prompt"])
        valid = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        outputs = self.engine.generate([prompts[i] for i in valid], self.params, use_tqdm=False)
        by_row = dict(zip(valid, outputs))
        rows = [self._row(by_row[i]) if i in by_row else self._missing_row() for i in range(len(prompts))]
        columns: dict[str, Any] = dict(batch)
        columns.update({name: [row[name] for row in rows] for name in OUTPUT_COLUMNS})
        return columns

    def _row(self, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        traces = completion.traces or []
        readouts = [t.exit_loop for t in traces]
        return {"prompt": output.prompt, "text": completion.text, "token_ids": list(completion.token_ids),
                "finish_reason": completion.finish_reason, "error": completion.error,
                "loops": self.loops, "exit_policy": self.exit_policy,
                "mean_loops_run": _mean([len(t.exit_pdf) for t in traces]),
                "mean_readout_loops": None if None in readouts else _mean([r + 1 for r in readouts])}

    def _missing_row(self) -> dict[str, Any]:
        return {"prompt": None, "text": "", "token_ids": [], "finish_reason": "error",
                "error": "prompt is missing", "loops": self.loops, "exit_policy": self.exit_policy,
                "mean_loops_run": None, "mean_readout_loops": None}


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def file_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: cannot tell the format from the suffix {suffix!r}; "
                         f"use one of {', '.join(FORMATS)}")
    return FORMATS[suffix]


def check_prompts(path: str | Path) -> None:
    """A JSONL (one object per line) or Parquet file of requests with a `prompt` column, checked before any
    worker starts, so a malformed file fails naming its line or column and not in the middle of a run."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    if file_format(path) == "jsonl":
        columns = check_jsonl(path)
    else:
        schema = pq.read_schema(path)
        columns = schema.names
        if "prompt" in columns and not pa.types.is_string(schema.field("prompt").type):
            raise ValueError(f"{path}: column 'prompt' must hold strings, not {schema.field('prompt').type}")
    if "prompt" not in columns:
        raise ValueError(f"{path}: no 'prompt' column (columns: {', '.join(columns) or 'none'})")
    clashes = sorted(set(columns) & set(OUTPUT_COLUMNS) - {"prompt"})
    if clashes:
        raise ValueError(f"{path}: column(s) {', '.join(clashes)} would be overwritten by the output; "
                         "rename them")


def read_prompts(path: str | Path) -> ray.data.Dataset:
    """The prompts file as a Dataset, by Ray's readers (run check_prompts first)."""
    if file_format(path) == "jsonl":
        return ray.data.read_json(str(path))  # pyarrow's reader: reads JSONL, and keeps "12" a string
    return ray.data.read_parquet(str(path))


def check_jsonl(path: Path) -> list[str]:
    """Every non-blank line a JSON object whose prompt, if given, is a string; returns the keys seen.
    A null or missing prompt is left to become an error row."""
    columns: dict[str, None] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            if row.get("prompt") is not None and not isinstance(row["prompt"], str):
                raise ValueError(f"{path}:{number}: prompt must be a string, got {row['prompt']!r}")
            columns.update(dict.fromkeys(row))
    return list(columns)


def generate(ds: ray.data.Dataset, model: str | None = None, engine_kwargs: dict[str, Any] | None = None,
             params: SamplingParams | None = None, num_workers: int = 1, batch_size: int = 64,
             device: str = "cpu", cpus_per_worker: float = 1.0) -> ray.data.Dataset:
    """`ds` with every row's completion added, by `num_workers` actors each holding one Engine on `device`
    (one GPU per actor on "cuda"). Rows keep their input order."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    engine_kwargs = dict(engine_kwargs or {}, device=device)
    ds.context.execution_options.preserve_order = True
    worker = {"model": model, "engine_kwargs": engine_kwargs, "params": params or SamplingParams()}
    return ds.map_batches(EngineWorker, fn_constructor_kwargs=worker, batch_size=batch_size,
                          compute=ray.data.ActorPoolStrategy(size=num_workers), num_cpus=cpus_per_worker,
                          num_gpus=1 if device == "cuda" else 0)


def check_capacity(num_workers: int, cpus_per_worker: float, device: str) -> None:
    """Ray Data reads and writes in tasks of one CPU each: workers holding every CPU would wait forever."""
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if num_workers * cpus_per_worker > cpus - 1:
        raise ValueError(f"{num_workers} workers x {cpus_per_worker} CPUs leave none of the cluster's "
                         f"{cpus:g} CPUs for reading and writing; lower --num-workers or --cpus-per-worker "
                         "(e.g. 0.5)")
    if device == "cuda" and num_workers > gpus:
        raise ValueError(f"{num_workers} workers need a GPU each; the cluster has {gpus:g}")


def write_results(ds: ray.data.Dataset, output: str | Path, output_format: str = "jsonl") -> None:
    """Write `ds` under the directory `output`, one file per block; an existing directory is an error, so
    two runs never mix."""
    if output_format == "jsonl":
        ds.write_json(str(output), mode=SaveMode.ERROR)
    elif output_format == "parquet":
        ds.write_parquet(str(output), mode=SaveMode.ERROR)
    else:
        raise ValueError(f"output format must be jsonl or parquet, got {output_format!r}")


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """["block_size=32", "kv_sharing=last"] -> {"block_size": 32, "kv_sharing": "last"}
    (engine.engine_kwargs); the Engine arguments that have their own flag here are refused."""
    kwargs = engine_kwargs(pairs, "engine-arg")
    for key in kwargs:
        if key in OWN_FLAGS:
            raise ValueError(f"--engine-arg {key}: use --{key.replace('_', '-')} instead")
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.ray_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="prompts file: .jsonl or .parquet")
    parser.add_argument("--output", required=True, help="output directory (must not exist)")
    parser.add_argument("--output-format", default="jsonl", choices=["jsonl", "parquet"])
    parser.add_argument("--num-workers", type=int, default=1, help="actors, one Engine each (default 1)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0,
                        help="CPUs Ray reserves per worker (default 1); one more must stay free for reading "
                             "and writing")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (default 64)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cuda: one GPU per worker (default: cuda if the Ray cluster has GPUs)")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or Hugging Face repo id (default: the embedded tiny one)")
    parser.add_argument("--loops", type=int, default=None, help="loop count T (default: the checkpoint's)")
    parser.add_argument("--exit-policy", default=None,
                        help="full (default), threshold:Q, step:K, weighted or early:Q")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default auto)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="any other Engine keyword argument, e.g. kv_sharing=last; repeatable")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampling")
    parser.add_argument("--loop-trace", action="store_true",
                        help="trace every token's loops: fills mean_loops_run and mean_readout_loops")
    return parser


def run(args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, loop_trace=args.loop_trace)
    engine_kwargs = {"loops": args.loops, "exit_policy": args.exit_policy, "dtype": args.dtype,
                     **parse_engine_args(args.engine_arg)}
    if args.num_workers < 1 or args.batch_size < 1 or args.cpus_per_worker < 0:
        raise ValueError("--num-workers and --batch-size must be positive, --cpus-per-worker not negative")
    check_prompts(args.input)
    output = Path(args.output).resolve()  # Ray's write tasks do not run in this working directory
    if output.exists():
        raise FileExistsError(f"{args.output}: already exists; pick a new output directory")
    model = args.model
    if model is not None and Path(model).exists():
        model = str(Path(model).resolve())
    local = not ray.is_initialized() and args.address is None
    if not ray.is_initialized():
        ray.init(address=args.address)
    device = args.device or ("cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu")
    if local:  # a cluster joined by --address may autoscale, so only a local one is checked
        check_capacity(args.num_workers, args.cpus_per_worker, device)
    ds = generate(read_prompts(Path(args.input).resolve()), model, engine_kwargs, params, args.num_workers,
                  args.batch_size, device, args.cpus_per_worker)
    write_results(ds, output, args.output_format)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
