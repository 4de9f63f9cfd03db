"""The command line: `loop-engine generate`, `loop-engine eval` (a paired eval of two configs,
benchmarks/paired_eval.py) and `loop-engine serve` (server/app.py); `python engine.py ...` from the repository
root is the same. It parses, builds an Engine from the engine flags, and prints; the engine never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from cache.kv_formats import FORMATS
from engine import DEFAULT_MODEL, Engine
from request import CompletionOutput, SamplingParams
from scheduler.scheduler import KV_POOL_FULL


def default_cpu_threads() -> int:
    """The CLI's CPU thread count (--threads auto): the cores this process may use, less those busy with
    other work by the 1-minute load average (rounded; recent runs of this program count too), at least 1 and
    at most torch's current count (by default the physical cores). On a shared machine OpenMP threads that
    wait for a core another process holds stall every op: with one of two cores busy, the tiny model ran
    2-8x slower on 2 threads than on 1, Ouro-1.4B's shape 4-7x; on an idle machine 2 threads were 1.25x
    (tiny) and 2x (1.4B) faster than 1 (README, "On a CPU")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = round(os.getloadavg()[0])
    except (AttributeError, OSError):  # no load average (Windows): assume idle
        busy = 0
    return max(1, min(cores - busy, torch.get_num_threads()))



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="loop-engine: inference for looped LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt (or a file of prompts) and print it "
                                          "with tok/s")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    what = gen.add_mutually_exclusive_group()
    what.add_argument("--prompt", default=None, help="raw text prompt (default: a short sample sentence)")
    what.add_argument("--chat", default=None,
                      help="a user message, formatted with the chat template; prints the answer only")
    what.add_argument("--prompts-file", default=None,
                      help="one prompt per line, or with a .jsonl suffix one JSON object per line with a "
                           "\"prompt\" string; prints one JSON line per prompt, in input order")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64,
                          help="tokens to generate at most (default 64)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling mass (default 1.0: off)")
    sampling.add_argument("--top-k", type=int, default=0,
                          help="keep the k most likely tokens (default 0: off)")
    sampling.add_argument("--min-p", type=float, default=0.0,
                          help="drop tokens below min_p x the top token's probability (default 0: off)")
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampling")
    sampling.add_argument("--stop", action="append", default=None, metavar="TEXT",
                          help="stop at this string (repeatable; \\n, \\t and \\\\ are read as newline, tab "
                               "and backslash)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    sampling.add_argument("--min-tokens", type=int, default=0,
                          help="stops and end-of-sequence count only after this many tokens (default 0)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="divide the logit of every token already seen (default 1.0: off)")
    sampling.add_argument("--presence-penalty", type=float, default=0.0,
                          help="subtract from the logit of every token already generated (default 0)")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="subtract this x its count from a generated token's logit (default 0)")
    add_engine_flags(gen.add_argument_group("engine"))
    output = gen.add_argument_group("output")
    output.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    output.add_argument("--loop-trace", action="store_true",
                        help="print each generated token's exit loop and exit pdf")
    sub.add_parser("eval", add_help=False,
                   help="paired eval of two configs on a frozen protocol (eval --help)")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the [serve] extra; "
                                         "docs/serving.md)")
    serve.add_argument("--model", default=None,
                       help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    add_engine_flags(serve.add_argument_group("engine"))
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000,
                      help="port to listen on; 0: any free one (default 8000)")
    http.add_argument("--served-model-name", default=None,
                      help="the model's name in requests and responses (default: --model as given)")
    http.add_argument("--max-pending-requests", type=int, default=1024, metavar="N",
                      help="prompts held at once, waiting or running; one more is answered 429 "
                           "(default 1024)")
    http.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                      help="on SIGTERM, seconds in-flight requests get to finish before they are aborted "
                           "(default 10)")
    http.add_argument("--log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug"],
                      help="uvicorn's log level (default info)")
    return parser


def add_engine_flags(engine: argparse._ArgumentGroup) -> None:
    """The Engine's flags, shared by generate and serve (engine_from_args reads them)."""
    engine.add_argument("--loops", type=int, default=None,
                        help="loop count T (default: the checkpoint's total_ut_steps)")
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    engine.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default auto)")
    engine.add_argument("--attention", default="auto", help="attention backend: auto, torch or triton")
    engine.add_argument("--threads", default="auto", type=_threads,
                        help="torch CPU threads: a number, or auto (default): the cores not busy by the "
                             "1-minute load average, which avoids OpenMP stalls on a shared machine")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence, prompt + output (default: the checkpoint's limit)")
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks of 16 tokens (default: sized from memory)")
    engine.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV pool size in GiB (default: sized from memory; on CPU from max_model_len "
                             "and the memory available)")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, even on CUDA")
    engine.add_argument("--exit-policy", default=None,
                        help="full (default), threshold:Q, step:K (0-based), weighted, early:Q (stops "
                             "looping a generated token once its exit CDF reaches Q), or an exit criterion "
                             "C[:T][,min=M][,every=N] with C kl, minp-kl, entropy-diff, argmax-stability, "
                             "latent-diff or cosine (stops it once its checked loops settle; T default auto)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=list(FORMATS),
                        help="how K/V is stored: the model dtype (auto), bf16, fp8_e4m3 with one scale per "
                        "(slot, kv head), or a KVarN preset (with --block-size of its tile) (default auto)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    engine.add_argument("--kv-sink-tokens", type=int, default=0,
                        help="KVarN: the first N positions stay in high precision (default 0)")
    engine.add_argument("--kv-tail-tokens", type=int, default=0,
                        help="KVarN: the N newest positions stay in high precision (default 0)")
    engine.add_argument("--kv-no-rotation", action="store_true",
                        help="KVarN: no Hadamard rotation before normalizing (attention torch only)")
    engine.add_argument("--kv-sharing", default="none", choices=["none", "last"],
                        help="last: generated tokens keep only their last loop's K/V "
                             "(arXiv 2510.25741 §5.4.2)")
    engine.add_argument("--kv-layout", default=None, metavar="NAME",
                        help="K/V across loops: full, latest (an early-exited token's deeper slots read its "
                             "last computed loop), compress:k (a ring of k loop-layer slots, k a multiple of "
                             "the layers per loop) or latest-compress:k (default: latest under early:Q, "
                             "else full)")
    engine.add_argument("--speculative", default=None, metavar="loops:d",
                        help="self-speculative decoding: draft with the first d loops, verify with the rest "
                             "(lossless; docs/speculative.md)")
    engine.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="drafts per step under --speculative (default 4)")
    engine.add_argument("--admission", default="reserve", choices=["reserve", "greedy"],
                        help="reserve (default): admit a request only if the KV pool also covers what the "
                             "running ones are expected to claim; greedy: whenever it fits, preempting later")
    engine.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="schedule and prepare the next step while the device runs this one: auto "
                             "(default) is on for CUDA without --speculative or early:Q, off elsewhere")
    engine.add_argument("--piecewise-graph-tokens", type=int, default=512, metavar="N",
                        help="steps with prompt tokens, of at most N tokens, replay piecewise CUDA graphs "
                             "(attention eager between them); 0: such steps run eagerly (default 512)")
    engine.add_argument("--deterministic", default="auto", choices=["auto", "on", "off"],
                        help="batch invariance: a request's logits have the same bits whatever runs beside "
                             "it, eager or under CUDA graphs (docs/deterministic.md); auto (default): the "
                             "device's default")
    engine.add_argument("--max-num-seqs", type=int, default=256,
                        help="sequences that run at once (default 256)")
    engine.add_argument("--init-scale", type=float, default=None,
                        help="a model with an initial state (Huginn): the scale of each token's drawn state, "
                             "seeded by the request's --seed and the token's position; 0: the zero state "
                             "(default: the checkpoint's, else 1.0)")
    engine.add_argument("--continuous-compute", choices=["normalized", "raw"], default=None,
                        help="a model with an initial state (Huginn): warm-start each generated token from "
                             "the previous token's last state, after the final norm or raw (docs/huginn.md)")
    engine.add_argument("--depth-batching", action="store_true",
                        help="continuous depth batching: each decode step is one loop pass in which every "
                             "decode row runs its own next loop, so rows at different loops share one weight "
                             "read")
    engine.add_argument("--passes-per-step", type=int, default=None,
                        help="depth batching: loop passes a decode step chains on the device before the host "
                             "reads their tokens (default: four times the loops where chains apply, else 1)")
    engine.add_argument("--no-check-finite-weights", action="store_true",
                        help="skip the check that every weight is finite (no NaN or inf) as it loads: on a "
                             "CPU it takes about 7%% of the load")


def _threads(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a positive integer or auto, got {value!r}")
    return int(value)


def _unescape(text: str) -> str:
    """A --stop string: \\n, \\t and \\\\ as newline, tab and backslash, every other character as is."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


# What `generate --prompts-file` adds to each row in its output line; a JSONL row may not carry these itself.
OUTPUT_FIELDS = ("index", "text", "token_ids", "finish_reason", "stop_reason", "error")


def read_prompts_file(path: str | Path) -> list[dict[str, Any]]:
    """The rows of --prompts-file, each with its "prompt": every line one (an empty line is an empty prompt,
    which fails alone). A .jsonl file holds one JSON object per line with a "prompt" string, whose other
    fields (an id, say) the output line carries along unchanged; a line that is not one, or that has a field
    the output line sets (OUTPUT_FIELDS), raises ValueError naming the file, line and field, before any
    model loads."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise FileNotFoundError(f"--prompts-file {str(path)!r}: {err.strerror}") from None
    if path.suffix != ".jsonl":
        return [{"prompt": line} for line in lines]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--prompts-file {path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"--prompts-file {path}, line {number}: needs a \"prompt\" string")
        clash = [field for field in OUTPUT_FIELDS if field in row]
        if clash:
            raise ValueError(f"--prompts-file {path}, line {number}: field {clash[0]!r} is one the output "
                             f"line sets ({', '.join(OUTPUT_FIELDS)}), so it would be overwritten; rename it")
        rows.append(row)
    return rows


def cli_generate(args: argparse.Namespace) -> int:
    """Run `generate`; the exit status: 1 when any request failed (its error is printed), else 0."""
    if args.stream and args.prompts_file is not None:
        raise ValueError("--stream prints one prompt's tokens as they come; it does not take --prompts-file")
    rows = read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                            repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            stop=[_unescape(s) for s in args.stop] if args.stop else None,
                            loop_trace=args.loop_trace)
    with engine_from_args(args) as engine:
        if rows is not None:
            return _generate_batch(engine, rows, params)
        return _generate_one(engine, args, params)


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The Engine of the engine flags (add_engine_flags), after setting torch's CPU threads (--threads)."""
    threads = args.threads
    on_cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
    if threads == "auto" and on_cpu:
        threads = default_cpu_threads()
    if threads != "auto":
        torch.set_num_threads(threads)
    return Engine(args.model, device=args.device, dtype=args.dtype, attention=args.attention,
                  loops=args.loops, enforce_eager=args.enforce_eager, exit_policy=args.exit_policy,
                  kv_sharing=args.kv_sharing, kv_layout=args.kv_layout, max_model_len=args.max_model_len,
                  num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
                  speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                  admission=args.admission, kv_cache_dtype=args.kv_cache_dtype,
                  kv_sink_tokens=args.kv_sink_tokens, kv_tail_tokens=args.kv_tail_tokens,
                  kv_rotation=not args.kv_no_rotation,
                  block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                  async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                  piecewise_graph_tokens=args.piecewise_graph_tokens, max_num_seqs=args.max_num_seqs,
                  deterministic={"auto": None, "on": True, "off": False}[args.deterministic],
                  check_finite_weights=not args.no_check_finite_weights, init_scale=args.init_scale,
                  continuous_compute=args.continuous_compute, depth_batching=args.depth_batching,
                  passes_per_step=args.passes_per_step)


def cli_serve(args: argparse.Namespace) -> int:
    """Run `serve`: the Engine of the engine flags behind server/app.py's server, until SIGTERM or Ctrl-C.
    Imported here, not at the top: the server needs the [serve] extra, which generate does not."""
    try:
        from server.app import serve
    except ModuleNotFoundError as err:
        raise ValueError(f"serve needs the [serve] extra: pip install -e \".[serve]\" ({err})") from None
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be at least 1, got {args.max_pending_requests}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    name = args.served_model_name or args.model or DEFAULT_MODEL.name
    with engine_from_args(args) as engine:
        return serve(engine, name, args.host, args.port, args.max_pending_requests, args.shutdown_timeout,
                     args.log_level)


def _generate_one(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> int:
    if args.chat is not None:  # the answer only: the user typed the message, the ChatML around it is noise
        prompt, shown = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.chat}]), ""
    else:
        prompt = shown = args.prompt if args.prompt is not None else "A looped language model"
    start = time.perf_counter()
    if args.stream:
        printed = None
        for result in engine.stream([prompt], params):
            completion = result.outputs[0]
            if printed is None and completion.finish_reason != "error":
                print(shown, end="", flush=True)
                printed = ""
            if printed is not None:
                print(completion.text[len(printed):], end="", flush=True)
                printed = completion.text
        if printed is not None:
            print()
    else:
        result = engine.generate([prompt], params, use_tqdm=False)[0]
        completion = result.outputs[0]
        if completion.finish_reason != "error":
            print(shown + completion.text)
    elapsed = time.perf_counter() - start
    if completion.finish_reason == "error":
        print(f"error: {completion.error}", file=sys.stderr)
        return 1
    n = len(completion.token_ids)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    loops = engine.engine_config.loops
    if engine.loop_stats.decode_tokens:  # weights are read once per loop run
        loops = engine.loop_stats.loops_per_token
    drafts = engine.speculative_stats
    if drafts is not None and drafts.tokens:  # one batch row: a step reads the weights k*d + (T - d) times
        d = engine.engine_config.draft_loops
        loops = (d * drafts.num_drafted + (engine.engine_config.loops - d) * drafts.steps) / drafts.tokens
        print(f"speculative {engine.engine_config.speculative}: {drafts.acceptance_rate:.1%} of "
              f"{drafts.num_drafted} drafts accepted, {drafts.tokens_per_step:.2f} tokens per step",
              file=sys.stderr)
    print(f"\n{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s, "
          f"{n * loops * weight_bytes / elapsed / 1e9:.2f} GB/s of weights read "
          f"({loops:.3g} loops, {torch.get_num_threads()} CPU threads), "
          f"finish_reason={completion.finish_reason}", file=sys.stderr)
    _note_kv_pool_full(engine, [completion])
    if args.loop_trace:
        _print_traces(engine, completion)
    return 0


def _generate_batch(engine: Engine, rows: list[dict[str, Any]], params: SamplingParams) -> int:
    """Every prompt through one generate() (continuous batching; its progress bar counts generated tokens,
    with tok/s, on stderr), then one JSON line per prompt on stdout, in input order; a failed request is
    reported on stderr and in its line."""
    start = time.perf_counter()
    outputs = engine.generate([row["prompt"] for row in rows], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    failed = 0
    for index, (row, out) in enumerate(zip(rows, outputs)):
        completion = out.outputs[0]
        produced = (index, completion.text, completion.token_ids, completion.finish_reason,
                    completion.stop_reason, completion.error)
        print(json.dumps({**row, **dict(zip(OUTPUT_FIELDS, produced))}))
        if completion.finish_reason == "error":
            failed += 1
            print(f"error: prompt {index} (line {index + 1}): {completion.error}", file=sys.stderr)
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(f"{len(rows)} prompts, {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s "
          f"({torch.get_num_threads()} CPU threads), {failed} failed", file=sys.stderr)
    _note_kv_pool_full(engine, [out.outputs[0] for out in outputs])
    return 1 if failed else 0


def _note_kv_pool_full(engine: Engine, completions: list[CompletionOutput]) -> None:
    full = sum(c.stop_reason == KV_POOL_FULL for c in completions)
    if full:
        pool = engine.block_manager.num_blocks * engine.engine_config.block_size
        print(f"note: {full} sequence(s) ended because the KV pool ({pool} tokens) was full, not at "
              "--max-tokens (finish_reason 'length', stop_reason 'kv_pool_full'); raise "
              "--kv-cache-gib or --num-kv-blocks", file=sys.stderr)


def _print_traces(engine: Engine, completion: CompletionOutput) -> None:
    print("\n| token | text | exit loop | exit pdf per loop |\n|---|---|---|---|", file=sys.stderr)
    for token, trace in zip(completion.token_ids, completion.traces or []):
        pdf = " ".join(f"{p:.3f}" for p in trace.exit_pdf)
        text = engine.tokenizer.decode([token])
        print(f"| {token} | {text!r} | {trace.exit_loop} | {pdf} |", file=sys.stderr)


def main(argv: Iterable[str] | None = None) -> int:
    """`generate`, `eval` and `serve`, as `python engine.py ...` or the `loop-engine` console script. Returns
    the exit status; bad arguments or input exit with status 1 and the error on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # its own parser; imported only when asked for
        from benchmarks.paired_eval import main as eval_main

        eval_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        return cli_serve(args) if args.command == "serve" else cli_generate(args)
    except (ValueError, OSError) as err:  # bad input, a bad checkpoint, a file it cannot read: one line
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
