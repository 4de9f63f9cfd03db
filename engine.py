"""loop-engine: the Python API (Engine, in vLLM's shape) and the CLI, `python engine.py generate` and
`python engine.py eval` (a paired eval of two configs, benchmarks/paired_eval.py).

    from engine import Engine, SamplingParams
    with Engine() as engine:                     # the embedded tiny checkpoint, offline
        out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from attention.base import select
from cache.blocks import BlockManager
from cache.kv_pool import KVPool, kv_bytes_per_token
from cache.shared_kv import (SharedKVBlockManager, SharedKVLayout, check_kv_sharing, kv_report,
                             max_concurrent_sequences)
from model.config import OuroConfig
from model.early_exit import EarlyExit
from model.exit_policy import parse_exit_policy, request_policy
from model.loader import load_model, resolve_model_dir
from model.ouro import fused_kernels_available
from model.runner import ModelRunner
from model.tokenizer import Tokenizer
from scheduler.request import CompletionOutput, Request, RequestOutput, SamplingParams
from scheduler.scheduler import Scheduler

__all__ = ["Engine", "SamplingParams", "RequestOutput", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parent / "model" / "checkpoints" / "tiny-ouro"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
CPU_KV_BUDGET_BYTES = 256 * 2**20

Prompt = str | list[int]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu' or 'cuda')") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device.type!r} is not supported; use 'cpu' or 'cuda'")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: OuroConfig, device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's half dtype on CUDA, float32 on CPU (where bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if config.torch_dtype == "float32" else _DTYPES[config.torch_dtype]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


class Engine:
    """One model, one KV pool, one scheduler. Not thread-safe; one process, one device."""

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", attention: str = "auto", loops: int | None = None,
                 exit_threshold: float | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True,
                 packed_prefill: bool = False, enforce_eager: bool = False,
                 exit_policy: str | None = None, kv_sharing: str = "none", verbose: bool = True) -> None:
        _check_positive("block_size", block_size)
        _check_positive("max_num_seqs", max_num_seqs)
        _check_positive("max_num_batched_tokens", max_num_batched_tokens)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        self.device = resolve_device(device)
        self.model_dir = resolve_model_dir(model if model is not None else DEFAULT_MODEL)
        self.config = OuroConfig.from_file(self.model_dir / "config.json").with_overrides(loops,
                                                                                          exit_threshold)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.tokenizer = Tokenizer(self.model_dir)
        if exit_policy is not None and exit_threshold is not None:
            raise ValueError("pass exit_policy or exit_threshold (= exit_policy='threshold:Q'), not both")
        if exit_policy is None:
            exit_policy = "full" if exit_threshold is None else f"threshold:{exit_threshold}"
        self.exit_policy = parse_exit_policy(exit_policy, self.config.total_ut_steps)
        self.kv_sharing = check_kv_sharing(kv_sharing)
        # Generated tokens whose K/V differs from a prompt's: exited early, or stored for the last loop only.
        approximate_kv = not self.exit_policy.readout_only or self.kv_sharing == "last"
        if self.kv_sharing == "last":
            if attention not in ("auto", "torch"):  # the Triton kernels read one paged layout only
                raise ValueError(f"kv_sharing='last' is implemented in the torch attention backend only, got "
                                 f"attention={attention!r}; use attention='torch' (or 'auto')")
            attention = "torch"
        self.backend = select(attention, self.device, {"packed_prefill": packed_prefill})
        self.backend.check(self.dtype, self.config.head_dim, self.device)
        # Fused Triton kernels around the GEMMs on CUDA; the plain torch ops elsewhere.
        self.model = load_model(self.model_dir, self.config, self.device, self.dtype,
                                fused_kernels=self.device.type == "cuda" and fused_kernels_available())
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        if num_kv_blocks is None:
            num_kv_blocks = self._blocks_for_memory(block_size, gpu_memory_utilization,
                                                    max_num_batched_tokens)
        # One block more than the scheduler may hand out: the scratch block that graph padding rows write.
        self.kv_pool = KVPool(self.config, num_kv_blocks + 1, block_size, self.dtype, self.device)
        self.backend.bind(self.kv_pool.key_cache, self.kv_pool.value_cache, self.config.head_dim ** -0.5)
        if self.kv_sharing == "last":
            self.block_manager = SharedKVBlockManager(num_kv_blocks, block_size, self.config.total_ut_steps,
                                                      enable_prefix_caching)
        else:
            self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching,
                                              cache_generated=not approximate_kv)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs,
                                   max_num_batched_tokens, self.max_model_len,
                                   detokenize=self.tokenizer.decode, generated_one_per_step=approximate_kv)
        self.runner = ModelRunner(self.model, self.backend, block_size, self.device)
        self.runner.exit_policy = self.exit_policy
        tokenizer = self.tokenizer
        self.runner.token_text = functools.lru_cache(maxsize=None)(lambda t: tokenizer.decode([t]))
        if self.kv_sharing == "last":
            self.runner.shared_kv = SharedKVLayout(self.config.total_ut_steps, self.config.num_hidden_layers,
                                                   block_size, self.kv_pool.num_blocks, self.device)
        if not self.exit_policy.readout_only:
            self.runner.early_exit = EarlyExit(self.model, self.backend, self.exit_policy.value,
                                               kv_sharing=self.kv_sharing == "last")
        # early:Q shrinks the batch loop by loop and kv_sharing reads two layouts: both run eagerly.
        self.uses_cuda_graphs = (not enforce_eager and not approximate_kv and self.device.type == "cuda"
                                 and self.backend.capabilities.cuda_graphs)
        if self.uses_cuda_graphs:
            self.runner.capture_decode_graphs(max_num_seqs, self.max_model_len, scratch_block=num_kv_blocks)
        self._requests: dict[str, Request] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self.num_prefill_tokens = self.num_decode_tokens = 0
        if verbose:
            pool = self.kv_pool
            print(f"loop-engine: {self.config.total_ut_steps} loops x {self.config.num_hidden_layers} "
                  f"layers, {self.dtype}, {self.device}, attention={self.backend.name}, "
                  f"exit_policy={self.exit_policy}; "
                  f"{kv_report(self.config, self.dtype, num_kv_blocks, block_size, self.kv_sharing)} "
                  f"({pool.num_bytes / 2**30:.2f} GiB)", file=sys.stderr)

    def _blocks_for_memory(self, block_size: int, utilization: float, max_batched_tokens: int) -> int:
        """vLLM's rule on CUDA: what is left of utilization x total after the weights and a measured
        activation peak. On CPU a fixed budget."""
        if self.device.type != "cuda":
            budget = CPU_KV_BUDGET_BYTES
        else:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profile_run(max_batched_tokens)
            peak = torch.cuda.max_memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            others = total - free - torch.cuda.memory_reserved(self.device)
            budget = total * utilization - peak - others
        blocks = KVPool.blocks_for_budget(self.config, block_size, self.dtype, budget) - 1  # - scratch block
        if blocks < 1:
            need = kv_bytes_per_token(self.config, self.dtype) * block_size
            raise ValueError(f"no memory left for the KV cache (one block needs {need} bytes); raise "
                             "gpu_memory_utilization or lower max_num_batched_tokens")
        return blocks

    def max_concurrent_sequences(self, prompt_tokens: int, generated_tokens: int) -> int:
        """How many sequences of this shape the KV pool holds at once (kv_sharing="last" stores a generated
        token in 1/loops of a prompt token's bytes)."""
        bm = self.block_manager
        return max_concurrent_sequences(bm.num_blocks, prompt_tokens, generated_tokens, bm.block_size,
                                        self.config.total_ut_steps, self.kv_sharing)

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        states = self.model(ids, positions, lambda q, k, v, slot: q.clone(),
                            torch.arange(min(num_tokens, 256), device=self.device))
        self.model.compute_logits(states.hidden[-1])
        del states
        torch.cuda.synchronize(self.device)

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
        request = Request(request_id, token_ids, params, eos_token_ids=self.tokenizer.stop_token_ids)
        self._requests[request_id] = request
        self._prompts[request_id] = text
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        error = f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {self.config.vocab_size})" \
            if bad else None
        self.scheduler.add(request, error)
        return request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, run every loop of the model once, update. Returns an output
        for every request that advanced or finished in this step."""
        batch = self.scheduler.schedule()
        touched: list[Request] = []
        if batch.requests:
            for request, num_new in zip(batch.requests, batch.num_new_tokens):
                decoding = request.num_computed_tokens >= request.num_prompt_tokens
                if decoding:
                    self.num_decode_tokens += num_new
                else:
                    self.num_prefill_tokens += num_new
            sampled = self.runner.run(batch)
            finished = self.scheduler.update(batch, sampled)
            touched = [r for r, token in zip(batch.requests, sampled) if token is not None or r.is_finished]
        else:
            finished = self.scheduler.take_finished()
        seen = {id(r) for r in touched}
        touched += [r for r in finished if id(r) not in seen]
        outputs = [self._output(r) for r in touched]
        for r in finished:
            self.runner.release(r)
            self._requests.pop(r.request_id, None)
            self._prompts.pop(r.request_id, None)
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        text = request.output_text if request.is_finished else self.tokenizer.decode(request.output_token_ids)
        params = request.params
        completion = CompletionOutput(0, text, list(request.output_token_ids), request.finish_reason,
                                      request.stop_reason, request.error, list(request.traces) or None,
                                      list(request.logprobs) if params.logprobs is not None else None)
        prompt_logprobs = [None, *request.prompt_logprobs] if params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, self._prompts.get(request.request_id),
                             request.prompt_token_ids, [completion], request.is_finished,
                             request.num_cached_tokens, prompt_logprobs)

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
            for out in self.step():
                if out.request_id in ids:
                    if out.finished:
                        ids.discard(out.request_id)
                    yield out

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
            for out in self.step():
                if out.request_id in wanted and out.finished:
                    results[out.request_id] = out
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


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
                     help="last: generated tokens keep only their last loop's K/V (paper §5.4.2; torch "
                          "attention)")
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
        early = engine.runner.early_exit
        if early is not None and early.stats.decode_tokens:  # weights are read once per loop run
            loops = early.stats.loops_per_token
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
