"""loop-engine: the Python API (Engine, in vLLM's shape) and the CLI, `python engine.py generate` and
`python engine.py eval` (a paired eval of two configs, benchmarks/paired_eval.py).

    from engine import Engine, SamplingParams
    with Engine() as engine:                     # the embedded tiny checkpoint, offline
        out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from attention.base import select
from cache.blocks import BlockManager
from cache.kv_pool import KVPool
from cache.layout import KV_SHARING, make_layout
from engine_config import EngineConfig
from model.config import OuroConfig
from model.loader import load_model
from model.ouro import fused_kernels_available
from model.tokenizer import Tokenizer
from request import (CompletionOutput, ExitPolicy, Request, RequestOutput, SamplingParams, ScheduledBatch,
                     request_policy)
from runner.interrupts import deferred_interrupts
from runner.loop_driver import LoopStats
from runner.model_runner import ModelRunner, StepResult
from scheduler.scheduler import Scheduler

__all__ = ["Engine", "SamplingParams", "RequestOutput", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parent / "model" / "checkpoints" / "tiny-ouro"
CPU_KV_BUDGET_BYTES = 256 * 2**20

Prompt = str | list[int]


class Engine:
    """One model, one KV pool, one scheduler. Not thread-safe; one process, one device.

    Construction resolves and validates every option once (engine_config.EngineConfig), then builds each
    component from that frozen config: attention backend, model, KV pool and layout, block manager,
    scheduler, and the step runner (which captures CUDA graphs on CUDA)."""

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", attention: str = "auto", loops: int | None = None,
                 exit_threshold: float | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True,
                 packed_prefill: bool = False, enforce_eager: bool = False,
                 exit_policy: str | None = None, kv_sharing: str = "none", verbose: bool = True) -> None:
        if not isinstance(verbose, bool):
            raise ValueError(f"verbose must be True or False, got {verbose!r}")
        self.engine_config = config = EngineConfig.resolve(
            model if model is not None else DEFAULT_MODEL, device, dtype, loops, exit_threshold, exit_policy,
            attention=attention,
            block_size=block_size, num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            packed_prefill=packed_prefill, enforce_eager=enforce_eager, kv_sharing=kv_sharing)
        model_dir = config.model_dir
        self.config: OuroConfig = config.model
        self.tokenizer = Tokenizer(model_dir)
        self.backend = select(config.attention, config.device, {"packed_prefill": config.packed_prefill})
        self.backend.check(config.dtype, self.config.head_dim, config.device)
        layout_name = KV_SHARING[config.kv_sharing]
        if layout_name not in self.backend.capabilities.kv_formats:
            raise ValueError(f"kv_sharing={config.kv_sharing!r} needs the {layout_name!r} KV format, which "
                             f"attention={self.backend.name!r} does not provide "
                             f"(it has {', '.join(self.backend.capabilities.kv_formats)})")
        # Fused Triton kernels around the GEMMs on CUDA; the plain torch ops elsewhere.
        self.model = load_model(model_dir, self.config, config.device, config.dtype,
                                fused_kernels=config.device.type == "cuda" and fused_kernels_available())
        loops, layers = config.loops, self.config.num_hidden_layers
        pool_shape = (config.block_size, self.config.num_key_value_heads, self.config.head_dim, config.dtype,
                      config.device)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(KVPool(loops, layers, 1, *pool_shape))
        # One block more than the scheduler may hand out: the scratch block that graph padding rows write.
        self.kv_pool = KVPool(loops, layers, num_blocks + 1, *pool_shape)
        self.backend.bind(self.kv_pool.key_cache, self.kv_pool.value_cache, self.config.head_dim ** -0.5)
        self.layout = make_layout(config.kv_sharing, loops, layers, config.block_size,
                                  config.generated_kv_exact)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          layout=self.layout)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, self.tokenizer)
        self.runner = ModelRunner(config, self.model, self.backend, self.kv_pool, self.layout,
                                  scratch_block=num_blocks, token_text=self.tokenizer.token_text)
        self._requests: dict[str, Request] = {}
        self._unreported: list[Request] = []  # finished, but their outputs never reached the caller
        self._handed_back: list[Request] = []  # what the last _step() returned, until step() delivered it
        self._ids = itertools.count()
        self.num_prefill_tokens = self.num_decode_tokens = 0
        if verbose:
            print(f"loop-engine: {loops} loops x {layers} layers, {config.dtype}, {config.device}, "
                  f"attention={self.backend.name}, exit_policy={config.exit_policy}; "
                  f"{self.layout.report(self.kv_pool, num_blocks)} "
                  f"({self.kv_pool.num_bytes / 2**30:.2f} GiB)", file=sys.stderr)

    @property
    def device(self) -> torch.device:
        return self.engine_config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_config.dtype

    @property
    def exit_policy(self) -> ExitPolicy:
        return self.engine_config.exit_policy

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.uses_cuda_graphs

    @property
    def loop_stats(self) -> LoopStats:
        """Decode tokens and the loops they ran (fewer than loops x tokens under early:Q)."""
        return self.runner.loop_stats

    def _blocks_for_memory(self, probe: KVPool) -> int:
        """vLLM's rule on CUDA: what is left of utilization x total after the weights and a measured
        activation peak. On CPU a fixed budget. `probe`: a one-block pool, for the bytes per block."""
        config = self.engine_config
        if config.device.type != "cuda":
            budget = CPU_KV_BUDGET_BYTES
        else:
            torch.cuda.reset_peak_memory_stats(config.device)
            self._profile_run(config.max_num_batched_tokens)
            peak = torch.cuda.max_memory_allocated(config.device)
            free, total = torch.cuda.mem_get_info(config.device)
            others = total - free - torch.cuda.memory_reserved(config.device)
            budget = total * config.gpu_memory_utilization - peak - others
        blocks = KVPool.blocks_for_budget(probe.bytes_per_block, budget) - 1  # - the scratch block
        if blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block needs {probe.bytes_per_block} "
                             "bytes); raise gpu_memory_utilization or lower max_num_batched_tokens")
        return blocks

    def max_concurrent_sequences(self, prompt_tokens: int, generated_tokens: int) -> int:
        """How many sequences of this shape the KV pool holds at once (kv_sharing="last" stores a generated
        token in 1/loops of a prompt token's bytes)."""
        return self.layout.max_concurrent_sequences(self.block_manager.num_blocks, prompt_tokens,
                                                    generated_tokens)

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int) -> None:
        device = self.engine_config.device
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, device=device)
        states = self.model(ids, positions, lambda q, k, v, slot: q.clone(),
                            torch.arange(min(num_tokens, 256), device=device))
        self.model.compute_logits(states.hidden[-1])
        del states
        torch.cuda.synchronize(device)

    # -- requests ------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt, index: int) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return list(prompt), None
        raise ValueError(f"prompts[{index}] must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. A bad prompt fails this request alone
        (finish_reason 'error')."""
        token_ids, text = self._encode(prompt, 0)
        return self._add(token_ids, text, self._check_params(params), request_id)

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_policy(params.exit_policy, self.exit_policy, self.config.total_ut_steps)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.config.vocab_size:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is more than the vocabulary "
                                 f"({self.config.vocab_size} tokens)")
        return params

    def _add(self, token_ids: list[int], text: str | None, params: SamplingParams,
             request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, eos_token_ids=self.tokenizer.stop_token_ids,
                          prompt=text)
        self._requests[request_id] = request
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        error = f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {self.config.vocab_size})" \
            if bad else None
        self.scheduler.add(request, error)
        return request_id

    def abort(self, request_id: str) -> None:
        with deferred_interrupts():
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unreported)

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, run the model's loops once, update. Returns an output for every
        request that advanced or finished in this step. If the outputs never reach the caller (an exception
        while building them, KeyboardInterrupt included), the finished requests among them come back from the
        next step instead."""
        self._handed_back = []
        try:
            outputs = [self._output(r) for r in self._step()]
            self._handed_back = []
        except BaseException:
            self._requeue_handed_back()
            raise
        return outputs

    def _step(self) -> list[Request]:
        """One iteration; the requests that advanced or finished in it, after those finished earlier whose
        outputs never reached a caller. Outputs are built by the caller, only for the requests it hands out;
        a caller that fails to deliver them calls _requeue_handed_back().

        A step applies whole or not at all. schedule() and the commit (the scheduler's update and the runner's
        commit) run with Ctrl-C deferred (runner/interrupts.py); the model's run between them changes no
        request, and the runner undoes what it does change (seeded generators, loop counters) if the step
        stops there. What schedule() decided (admissions, block allocations, preemptions) stands: each is a
        consistent state that the next schedule() starts from, and none changes a request's tokens, text or
        logprobs. A failure of one request (its sampling, its detokenizing) finishes it alone with
        finish_reason "error"."""
        self._handed_back = []
        with deferred_interrupts():
            batch = self.scheduler.schedule()
        result = None
        if batch.requests:
            try:
                result = self.runner.run(batch)
            except BaseException:
                self.runner.rollback()
                raise
        try:
            with deferred_interrupts():
                touched = self._commit(batch, result)
        except BaseException:  # before the commit: nothing applied; after it (a deferred Ctrl-C): all of it
            self.runner.rollback()
            self._requeue_handed_back()
            raise
        return touched

    def _commit(self, batch: ScheduledBatch, result: StepResult | None) -> list[Request]:
        """Apply the step (nothing, if the scheduler's update raises) and hand back what it touched."""
        touched: list[Request] = []
        if result is not None:
            decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
            before = [r.num_tokens for r in batch.requests]
            finished = self.scheduler.update(batch, result.tokens, result.errors)
            self.runner.commit(result)
            touched = [r for r, n in zip(batch.requests, before) if r.num_tokens > n or r.is_finished]
            for row, (is_decode, num_new) in enumerate(zip(decode, batch.num_new_tokens)):
                if row not in result.errors:
                    if is_decode:
                        self.num_decode_tokens += num_new
                    else:
                        self.num_prefill_tokens += num_new
        else:
            finished = self.scheduler.take_finished()
        seen = {id(r) for r in touched}
        touched += [r for r in finished if id(r) not in seen]
        for r in finished:
            self.runner.release(r)
            self._requests.pop(r.request_id, None)
        touched, self._unreported = self._unreported + touched, []
        self._handed_back = touched
        return touched

    def _requeue_handed_back(self) -> None:
        """The last _step()'s requests did not reach the caller: its finished ones come back next step."""
        with deferred_interrupts():
            self._unreported += [r for r in self._handed_back if r.is_finished]
            self._handed_back = []

    def _output(self, request: Request) -> RequestOutput:
        params = request.params
        completion = CompletionOutput(0, request.output_text, request.output_token_ids, request.finish_reason,
                                      request.stop_reason, request.error, list(request.traces) or None,
                                      list(request.logprobs) if params.logprobs is not None else None)
        prompt_logprobs = [None, *request.prompt_logprobs] if params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.is_finished, request.num_cached_tokens, prompt_logprobs)

    # -- convenience ---------------------------------------------------------------------------------

    def _add_all(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            per_prompt = params
        else:
            per_prompt = [params] * len(prompts)
        # Validate every prompt and parameter set before adding any, so a bad input adds nothing.
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        checked = [self._check_params(sp) for sp in per_prompt]
        return [self._add(ids, text, sp) for (ids, text), sp in zip(encoded, checked)]

    def stream(self, prompts: Prompt | list[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Incremental outputs as they are produced: each carries the completion so far."""
        ids = set(self._add_all(prompts, sampling_params))
        while ids:
            for request in self._step():
                if request.request_id in ids:
                    if request.is_finished:
                        ids.discard(request.request_id)
                    yield self._output(request)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        ids = self._add_all(prompts, sampling_params)
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        prefill0, decode0, start = self.num_prefill_tokens, self.num_decode_tokens, time.perf_counter()
        while len(results) < len(ids):
            for request in self._step():
                if request.is_finished and request.request_id in wanted:
                    results[request.request_id] = self._output(request)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"prefill {(self.num_prefill_tokens - prefill0) / elapsed:.0f} tok/s, "
                                    f"decode {(self.num_decode_tokens - decode0) / elapsed:.0f} tok/s",
                                    refresh=False)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (ChatML if none), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Free the model and the KV pool (device memory included)."""
        for name in ("runner", "scheduler", "block_manager", "backend", "kv_pool", "model"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_arguments() -> list[str]:
    """The keyword arguments an Engine takes (verbose aside)."""
    return [name for name in inspect.signature(Engine.__init__).parameters if name not in ("self", "verbose")]


def check_engine_kwargs(kwargs: dict[str, Any], flag: str) -> None:
    """Raise ValueError naming `--flag` for a key that is no Engine argument."""
    known = engine_arguments()
    for key in kwargs:
        if key not in known:
            raise ValueError(f"--{flag}: {key!r} is not an Engine argument; choose from {', '.join(known)}")


def engine_kwargs(pairs: Iterable[str], flag: str) -> dict[str, Any]:
    """KEY=VALUE strings from a command line as Engine keyword arguments. A value is read as JSON when it
    parses (4, 0.5, true and null are numbers, booleans and None), else kept as a string. A pair without a
    key, an unknown key or a repeated one raises ValueError naming `--flag`."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--{flag}: {pair!r} must be KEY=VALUE")
        if key in kwargs:
            raise ValueError(f"--{flag}: {key!r} is given twice")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    check_engine_kwargs(kwargs, flag)
    return kwargs


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="requests", dynamic_ncols=True)


# -- CLI -------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine.py", description="loop-engine: inference for looped LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from one prompt and print it with tok/s")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    what = gen.add_mutually_exclusive_group()
    what.add_argument("--prompt", default=None, help="raw text prompt (default: a short sample sentence)")
    what.add_argument("--chat", default=None, help="a user message, formatted with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampling")
    gen.add_argument("--loops", type=int, default=None,
                     help="loop count T (default: the checkpoint's total_ut_steps)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default auto)")
    gen.add_argument("--attention", default="auto", help="attention backend: auto, torch or triton")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, even on CUDA")
    gen.add_argument("--exit-policy", default=None,
                     help="full (default), threshold:Q, step:K (0-based), weighted, or early:Q (stops "
                          "looping a generated token once its exit CDF reaches Q)")
    gen.add_argument("--kv-sharing", default="none", choices=["none", "last"],
                     help="last: generated tokens keep only their last loop's K/V (arXiv 2510.25741 §5.4.2)")
    gen.add_argument("--loop-trace", action="store_true",
                     help="print each generated token's exit loop and exit pdf")
    sub.add_parser("eval", add_help=False,
                   help="paired eval of two configs on a frozen protocol (engine.py eval --help)")
    return parser


def cli_generate(args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, loop_trace=args.loop_trace)
    with Engine(args.model, device=args.device, dtype=args.dtype, attention=args.attention,
                loops=args.loops, enforce_eager=args.enforce_eager, exit_policy=args.exit_policy,
                kv_sharing=args.kv_sharing) as engine:
        if args.chat is not None:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.chat}])
        else:
            prompt = args.prompt if args.prompt is not None else "A looped language model"
        start = time.perf_counter()
        if args.stream:
            print(prompt, end="", flush=True)
            printed = ""
            for out in engine.stream([prompt], params):
                text = out.outputs[0].text
                print(text[len(printed):], end="", flush=True)
                printed = text
            print()
            result = out
        else:
            result = engine.generate([prompt], params, use_tqdm=False)[0]
            print(prompt + result.outputs[0].text)
        elapsed = time.perf_counter() - start
        n = len(result.outputs[0].token_ids)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        loops = engine.config.total_ut_steps
        if engine.loop_stats.decode_tokens:  # weights are read once per loop run
            loops = engine.loop_stats.loops_per_token
        print(f"\n{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s, "
              f"{n * loops * weight_bytes / elapsed / 1e9:.2f} GB/s of weights read "
              f"({loops:.3g} loops), finish_reason={result.outputs[0].finish_reason}", file=sys.stderr)
        if args.loop_trace:
            _print_traces(engine, result.outputs[0])


def _print_traces(engine: Engine, completion: CompletionOutput) -> None:
    print("\n| token | text | exit loop | exit pdf per loop |\n|---|---|---|---|", file=sys.stderr)
    for token, trace in zip(completion.token_ids, completion.traces or []):
        pdf = " ".join(f"{p:.3f}" for p in trace.exit_pdf)
        text = engine.tokenizer.decode([token])
        print(f"| {token} | {text!r} | {trace.exit_loop} | {pdf} |", file=sys.stderr)


def main(argv: Iterable[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # its own parser; imported only when asked for
        from benchmarks.paired_eval import main as eval_main

        eval_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        try:
            cli_generate(args)
        except (ValueError, FileNotFoundError) as err:
            sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
