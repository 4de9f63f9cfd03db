"""loop-engine: the Python API (Engine, in vLLM's shape) and the CLI, `loop-engine generate` and
`loop-engine eval` (a paired eval of two configs, benchmarks/paired_eval.py); `python engine.py ...` from the
repository root is the same.

    from engine import Engine, SamplingParams
    with Engine() as engine:                     # the embedded tiny checkpoint, offline
        out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from attention.registry import select
from cache.blocks import BlockManager
from cache.kv_format import KVARN_PRESETS, parse_kv_cache_dtype
from cache.kv_pool import KVPool
from cache.kvarn_pool import KVarNPool
from cache.layout import KV_SHARING, make_layout
from cache.side_rows import SideRows
from engine_config import EngineConfig
from model.registry import load_model
from model.tokenizer import Tokenizer
from request import (CompletionOutput, ExitPolicy, Request, RequestOutput, SamplingParams, ScheduledBatch,
                     SpeculativeStats, request_policy)
from runner.interrupts import deferred_interrupts
from runner.loop_driver import EagerLoops, LoopStats, StepInputs, run_loops
from runner.model_runner import LaunchedStep, ModelRunner, StepResult
from scheduler.scheduler import KV_POOL_FULL, Scheduler

__all__ = ["Engine", "LLM", "SamplingParams", "RequestOutput", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parent / "model" / "checkpoints" / "tiny-ouro"
# The CPU KV pool (see Engine._cpu_kv_budget): room for max_num_seqs sequences of max_model_len, but at most
# this share of the memory available once the weights are loaded (the rest is for activations and the
# machine's other work), and no more than the larger of one max_model_len sequence and CPU_KV_BYTES.
CPU_KV_BYTES = 4 * 2**30
CPU_KV_MEMORY_FRACTION = 0.5

# A prompt as vLLM takes it: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
Prepared = tuple[list[int], str | None, SamplingParams]  # a prompt's token ids, its text, its checked params


@dataclasses.dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request as its caller sees it: the n sequences sampled from its prompt (one scheduler Request
    each), and the inbox of the call that reads its outputs (generate(), a stream(), or step())."""

    request_id: str
    requests: list[Request]
    inbox: dict[str, SequenceGroup]

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.requests)


# A call's groups whose requests advanced or finished since it last looked, by request id, oldest first.
Inbox = dict[str, SequenceGroup]


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The scheduler ids of a request's n sequences: its own id when n == 1, else vLLM's f"{i}_{id}"."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s own parameters: n = 1 and, with a seed, seed + index (vLLM's derivation, so
    sample i of a seeded request is reproducible on its own)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in value)


def _take_all(inbox: Inbox) -> list[SequenceGroup]:
    groups = list(inbox.values())
    inbox.clear()
    return groups


class Engine:
    """One model, one KV pool, one scheduler. Not thread-safe; one process, one device.

    Construction resolves and validates every option once (engine_config.EngineConfig), then builds each
    component from that frozen config: attention backend, model, KV pool and layout, block manager,
    scheduler, and the step runner (which captures CUDA graphs on CUDA)."""

    _closed = False

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", attention: str = "auto", loops: int | None = None,
                 exit_threshold: float | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_gib: float | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 packed_prefill: bool = False, enforce_eager: bool = False,
                 exit_policy: str | None = None, kv_sharing: str = "none", speculative: str | None = None,
                 num_speculative_tokens: int | None = None, admission: str = "reserve",
                 kv_cache_dtype: str = "auto", kv_sink_tokens: int = 0, kv_tail_tokens: int = 0,
                 kv_rotation: bool = True, async_scheduling: bool | None = None,
                 piecewise_graph_tokens: int = 512, deterministic: bool | None = None,
                 check_finite_weights: bool = True,
                 verbose: bool = True) -> None:
        if not isinstance(verbose, bool):
            raise ValueError(f"verbose must be True or False, got {verbose!r}")
        self.engine_config = config = EngineConfig.resolve(
            model if model is not None else DEFAULT_MODEL, device, dtype, loops, exit_threshold, exit_policy,
            attention=attention, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_gib=kv_cache_gib, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            packed_prefill=packed_prefill, enforce_eager=enforce_eager, kv_sharing=kv_sharing,
            speculative=speculative, num_speculative_tokens=num_speculative_tokens, admission=admission,
            kv_cache_dtype=kv_cache_dtype, kv_sink_tokens=kv_sink_tokens, kv_tail_tokens=kv_tail_tokens,
            kv_rotation=kv_rotation, async_scheduling=async_scheduling,
            piecewise_graph_tokens=piecewise_graph_tokens, deterministic=deterministic,
            check_finite_weights=check_finite_weights)
        model_dir = config.model_dir
        self.config = config.model  # the checkpoint's config, of its family's class (model/registry.py)
        shape = config.model.shape
        self.tokenizer = Tokenizer(model_dir)
        self.backend = select(config.attention, config.device, {"packed_prefill": config.packed_prefill,
                                                                "batch_invariant": config.batch_invariant})
        self.backend.check(config.dtype, shape.head_dim, config.device)
        layout_name = KV_SHARING[config.kv_sharing]
        if layout_name not in self.backend.capabilities.kv_formats:
            raise ValueError(f"kv_sharing={config.kv_sharing!r} needs the {layout_name!r} KV format, which "
                             f"attention={self.backend.name!r} does not provide "
                             f"(it has {', '.join(self.backend.capabilities.kv_formats)})")
        self.model = load_model(model_dir, self.config, config.device, config.dtype, config.batch_invariant,
                                check_finite=config.check_finite_weights)
        loops, layers = config.loops, self.model.slot_map.loop_layers
        kvarn = parse_kv_cache_dtype(config.kv_cache_dtype).kind == "kvarn"
        side_rows = SideRows(config.max_num_seqs, config.block_size, config.kv_sink_tokens,
                             config.kv_tail_tokens, generated_apart=config.kv_sharing == "last") \
            if kvarn else None  # a KVarN pool's high-precision rows
        # One side block more than SideRows hands out: the scratch side block that graph padding rows write.
        side_blocks = side_rows.capacity + 1 if kvarn else 0
        generated_side_tiles = side_rows.generated_capacity if kvarn else 0
        probe = self._make_pool(1, 0, device=torch.device("meta"))  # its byte counts; nothing allocated
        reserved = probe.side_bytes_for(side_blocks, generated_side_tiles) if kvarn else 0
        # The pool asked for, or the smallest one (a block and the scratch block), before sizing it to memory
        self._check_pool_fits(probe, (config.num_kv_blocks or 1) + 1, reserved,
                              "num_kv_blocks" if config.num_kv_blocks is not None else "loops or block_size")
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(probe, reserved)
        # One block more than the scheduler may hand out: the scratch block that graph padding rows write.
        self.kv_pool = self._allocate_pool(probe, num_blocks + 1, reserved, side_blocks, generated_side_tiles)
        scale = shape.head_dim ** -0.5
        if kvarn:
            self.backend.bind_packed(self.kv_pool, scale)
        else:
            self.backend.bind(self.kv_pool.key_cache, self.kv_pool.value_cache, scale, self.kv_pool.kv_scales)
        # In deterministic mode a generated token's K/V stands for a prompt's (in the prefix cache, in a
        # recompute) only where the backend gives a prompt token what decoding it gives.
        exact = config.generated_kv_exact and (not config.batch_invariant
                                               or self.backend.capabilities.prefill_matches_decode)
        self.layout = make_layout(config.kv_sharing, self.model.slot_map, config.block_size, exact)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          layout=self.layout, side_rows=side_rows)
        if self.layout.blocks_per_sequence(config.max_model_len, 0) > num_blocks:
            warnings.warn(f"the KV pool holds {num_blocks * config.block_size} tokens, less than "
                          f"max_model_len {config.max_model_len}: a sequence that outgrows it ends with "
                          f"finish_reason 'length' and stop_reason {KV_POOL_FULL!r}. Raise kv_cache_gib or "
                          "num_kv_blocks, or lower max_model_len", stacklevel=2)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, self.tokenizer, config.speculative_tokens,
                                   config.admission)
        self.runner = ModelRunner(config, self.model, self.backend, self.kv_pool, self.layout,
                                  scratch_block=num_blocks, token_text=self.tokenizer.token_text,
                                  scratch_side_block=side_blocks - 1 if kvarn else None)
        self._requests: dict[str, Request] = {}  # every sequence the scheduler may still hand back, by id
        self._groups: dict[str, SequenceGroup] = {}  # by request id, until its finished output is handed out
        self._group_of: dict[str, SequenceGroup] = {}  # by sequence id, as long as the group
        self._step_inbox: Inbox = {}  # add_request()'s groups, read by step()
        self._unreported: list[Request] = []  # finished, but their outputs never reached a caller
        self._handed_back: list[Request] = []  # what the last _step() returned, until it was delivered
        self._unsettled: list[Callable[[], None]] = []  # parts of an applied step that raised (_run_parts)
        self._pending: LaunchedStep | None = None  # async scheduling: the step launched ahead, unresolved
        self._ids = itertools.count()
        self.num_prefill_tokens = self.num_decode_tokens = 0
        if verbose:
            speculation = f", speculative={config.speculative} x {config.speculative_tokens} tokens" \
                if config.speculative else ""
            kv = "" if config.kv_cache_dtype == "auto" else f", kv_cache_dtype={config.kv_cache_dtype}"
            kv += "" if config.kv_rotation else " (no rotation)"
            print(f"loop-engine: {loops} loops x {layers} layers, {config.dtype}{kv}, {config.device}, "
                  f"attention={self.backend.name}, exit_policy={config.exit_policy}{speculation}; "
                  f"{self.layout.report(self.kv_pool, num_blocks, side_rows=side_rows)} "
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

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Under speculative decoding, every request's drafts since the engine started: made and accepted,
        per draft position and overall (None without speculation)."""
        return self.runner.speculation.stats if self.runner.speculation is not None else None

    def _make_pool(self, num_blocks: int, side_blocks: int, generated_side_tiles: int = 0,
                   device: torch.device | None = None) -> KVPool | KVarNPool:
        """The KV pool of kv_cache_dtype: per-token elements (auto, bf16, fp8_e4m3) or KVarN tiles with
        side_blocks blocks of high-precision rows (and, under kv_sharing="last", generated_side_tiles tiles of
        generated ones). device: the engine's unless given (the meta device measures a pool's bytes)."""
        config, shape, slot_map = self.engine_config, self.engine_config.model.shape, self.model.slot_map
        device = config.device if device is None else device
        fmt = parse_kv_cache_dtype(config.kv_cache_dtype)
        heads = (shape.num_key_value_heads, shape.head_dim)
        if fmt.kind == "kvarn":
            return KVarNPool(fmt, slot_map, num_blocks, *heads, config.dtype, device,
                             config.kv_sink_tokens, config.kv_tail_tokens, side_blocks,
                             generated_side_tiles=generated_side_tiles, rotate=config.kv_rotation,
                             batch_invariant=config.batch_invariant)
        return KVPool(slot_map, num_blocks, config.block_size, *heads, fmt.storage_dtype(config.dtype),
                      device,
                      loop_uniform_scales=config.exit_policy.can_exit or config.kv_sharing == "last")

    def _allocate_pool(self, probe: KVPool | KVarNPool, num_blocks: int, reserved: int, side_blocks: int,
                       generated_side_tiles: int) -> KVPool | KVarNPool:
        """The KV pool of num_blocks blocks and `reserved` bytes of KVarN side rows, once _check_pool_fits;
        an allocation that fails all the same is a ValueError naming what sized the pool."""
        config = self.engine_config
        lower = "num_kv_blocks" if config.num_kv_blocks is not None else \
            "kv_cache_gib" if config.kv_cache_gib is not None else "loops or block_size"
        self._check_pool_fits(probe, num_blocks, reserved, lower)
        try:
            return self._make_pool(num_blocks, side_blocks, generated_side_tiles)
        except RuntimeError as err:  # the allocator's (torch's CUDA OutOfMemoryError is one)
            sized_by = self._pool_sized_by(probe, num_blocks, reserved)
            raise ValueError(f"allocating the KV pool ({sized_by}) on {config.device} failed: {err}; lower "
                             f"{lower}") from None

    def _check_pool_fits(self, probe: KVPool | KVarNPool, num_blocks: int, reserved: int, lower: str) -> None:
        """A pool of num_blocks blocks and `reserved` bytes of side rows against the memory the device has
        now, before anything is allocated: ValueError naming the options that sized it and those to lower."""
        config = self.engine_config
        needed = num_blocks * probe.bytes_per_block + reserved
        available = device_memory_available(config.device)
        if available is None or needed <= available:
            return
        if reserved > num_blocks * probe.bytes_per_block:
            lower = "max_num_seqs, or kv_sink_tokens and kv_tail_tokens"
        raise ValueError(f"the KV pool would take {needed / 2**30:.3g} GiB "
                         f"({self._pool_sized_by(probe, num_blocks, reserved)}), more than the "
                         f"{available / 2**30:.3g} GiB of memory available on {config.device}; lower {lower}")

    def _pool_sized_by(self, probe: KVPool | KVarNPool, num_blocks: int, reserved: int = 0) -> str:
        """The pool's size in the words of the options that set it."""
        config = self.engine_config
        asked = f"num_kv_blocks={config.num_kv_blocks}: " if config.num_kv_blocks is not None else \
            f"kv_cache_gib={config.kv_cache_gib}: " if config.kv_cache_gib is not None else ""
        side = (f", and {reserved / 2**30:.3g} GiB of KVarN side rows for max_num_seqs={config.max_num_seqs}"
                if reserved else "")
        return (f"{asked}{num_blocks} block(s) of {probe.bytes_per_block / 2**20:.3g} MiB, each "
                f"block_size={probe.block_size} tokens x loops={config.loops} x "
                f"{self.config.num_hidden_layers} layers{side}")

    def _blocks_for_memory(self, probe: KVPool | KVarNPool, reserved: int = 0) -> int:
        """kv_cache_gib when given. Otherwise vLLM's rule on CUDA: what is left of utilization x total after
        the weights and a measured activation peak; on CPU, _cpu_kv_budget. `probe`: a one-block pool, for
        the bytes per block; `reserved`: bytes of the budget that are not blocks (a KVarN side pool)."""
        config = self.engine_config
        if config.kv_cache_gib is not None:
            budget = config.kv_cache_gib * 2**30
        elif config.device.type != "cuda":  # sized for the blocks the sequences need; a side pool on top
            budget = self._cpu_kv_budget(probe.bytes_per_block) + reserved
        else:
            torch.cuda.reset_peak_memory_stats(config.device)
            try:
                self._profile_run(config.max_num_batched_tokens)
            except torch.cuda.OutOfMemoryError:
                raise ValueError(f"max_num_batched_tokens={config.max_num_batched_tokens}: a step of that "
                                 f"many tokens does not fit in {config.device}'s memory beside the weights; "
                                 "lower it") from None
            peak = torch.cuda.max_memory_allocated(config.device)
            free, total = torch.cuda.mem_get_info(config.device)
            others = total - free - torch.cuda.memory_reserved(config.device)
            budget = total * config.gpu_memory_utilization - peak - others
        blocks = KVPool.blocks_for_budget(probe.bytes_per_block, budget - reserved) - 1  # - the scratch block
        if blocks < 1:
            side = (f"; the KVarN side pool takes {reserved / 2**30:.2f} GiB of it (lower max_num_seqs or "
                    "kv_sink_tokens / kv_tail_tokens)") if reserved else ""
            raise ValueError(f"no memory left for the KV cache: its budget of {max(budget, 0) / 2**30:.3g} "
                             "GiB holds no block besides the scratch block "
                             f"({self._pool_sized_by(probe, 1)}); "
                             "raise kv_cache_gib, or on CUDA gpu_memory_utilization, or lower "
                             f"max_num_batched_tokens, loops or block_size{side}")
        return blocks

    def _cpu_kv_budget(self, bytes_per_block: int) -> float:
        """Bytes for the CPU KV pool: room for max_num_seqs sequences of max_model_len (more is never used),
        at most the larger of one such sequence and CPU_KV_BYTES, and at most CPU_KV_MEMORY_FRACTION of the
        memory available now (the weights are loaded; CPU_KV_BYTES where the OS does not say). The pool is
        allocated uninitialised, so its pages become resident only as tokens are written."""
        config = self.engine_config
        one_sequence = -(-config.max_model_len // config.block_size) * bytes_per_block
        available = available_memory_bytes()
        cap = CPU_KV_MEMORY_FRACTION * available if available is not None else CPU_KV_BYTES
        return min(config.max_num_seqs * one_sequence, max(one_sequence, CPU_KV_BYTES), cap) \
            + bytes_per_block  # the scratch block

    def max_concurrent_sequences(self, prompt_tokens: int, generated_tokens: int) -> int:
        """How many sequences of this shape the KV pool holds at once (kv_sharing="last" stores a generated
        token in 1/loops of a prompt token's bytes; a KVarN pool's side rows may hold fewer)."""
        return self.layout.max_concurrent_sequences(self.block_manager.num_blocks, prompt_tokens,
                                                    generated_tokens, self.block_manager.side_rows)

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int) -> None:
        device = self.engine_config.device
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, device=device)
        inputs = StepInputs(ids, positions, None, torch.arange(min(num_tokens, 256), device=device), [])
        executor = EagerLoops(self.model, None, lambda q, k, v, slot: q.clone())  # no KV: nothing stored
        states = run_loops(executor, self.model, inputs, range(self.engine_config.loops))
        self.model.compute_logits(states.hidden[-1])
        del states
        torch.cuda.synchronize(device)

    # -- requests ------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt, name: str) -> tuple[list[int], str | None]:
        """A prompt's token ids and its text (None for token ids). `name` (prompts[i], or prompt) names
        it in the error."""
        if isinstance(prompt, dict):
            keys = sorted(prompt)
            unknown = [k for k in keys if k not in PROMPT_KEYS]
            if unknown or len(keys) != 1:
                problem = f"unknown keys {unknown}" if unknown else f"keys {keys}"
                raise ValueError(f"{name} has {problem}: a dict prompt holds exactly one of 'prompt' (text) "
                                 "or 'prompt_token_ids' (a list of token ids)")
            key, value = keys[0], prompt[keys[0]]
            if key == "prompt" and not isinstance(value, str):
                raise ValueError(f"{name}['prompt'] must be a string, got {type(value).__name__}")
            if key == "prompt_token_ids" and not _is_token_ids(value):
                raise ValueError(f"{name}['prompt_token_ids'] must be a list of token ids")
            prompt = value
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if _is_token_ids(prompt):
            return list(prompt), None
        raise ValueError(f"{name} must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request for step(); returns its id, under which step() hands back its outputs (with
        n > 1, all n completions together). A bad prompt fails this request alone (finish_reason 'error');
        a request_id in use raises ValueError and adds nothing."""
        self._check_open()
        token_ids, text = self._encode(prompt, "prompt")
        params = self._check_params(params)
        if request_id is None:
            request_id = self._new_ids([params.n])[0]
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif not self._id_is_free(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._add(request_id, token_ids, text, params, self._step_inbox).request_id

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy of the params (SamplingParams.validate again: a field may have been set since they
        were built), which the request keeps, so a later change to the caller's params never reaches it."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        request_policy(params.exit_policy, self.exit_policy, self.engine_config.loops)
        speculative = self.engine_config.speculative
        if speculative is not None:
            for name, off in (("min_tokens", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
                if getattr(params, name) != off:
                    raise ValueError(f"SamplingParams.{name}={getattr(params, name)!r} cannot be combined "
                                     f"with speculative={speculative!r} yet: it changes each position's "
                                     f"logits by the tokens before it, which a draft does not know yet")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.config.vocab_size:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is more than the vocabulary "
                                 f"({self.config.vocab_size} tokens)")
        return params

    def _id_is_free(self, request_id: str, n: int) -> bool:
        """Neither the id nor its sequences' ids name a request, sequence or unread group."""
        return all(i not in self._requests and i not in self._groups and i not in self._group_of
                   for i in (request_id, *sequence_ids(request_id, n)))

    def _new_ids(self, ns: list[int]) -> list[str]:
        """Automatic ids for requests of ns[i] sequences: the counter's next values, skipping any a caller
        chose, so an automatic id never clashes. Digit strings, so they never clash with each other's
        sequence ids (f"{i}_{id}") either."""
        ids = []
        for n in ns:
            request_id = str(next(self._ids))
            while not self._id_is_free(request_id, n):
                request_id = str(next(self._ids))
            ids.append(request_id)
        return ids

    def _add(self, request_id: str, token_ids: list[int], text: str | None, params: SamplingParams,
             inbox: Inbox) -> SequenceGroup:
        """Queue the request's n sequences (ids checked by the caller); `inbox` gets its outputs."""
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        error = f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {self.config.vocab_size})" \
            if bad else None
        group = self._groups[request_id] = SequenceGroup(request_id, [], inbox)
        for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
            request = Request(sequence_id, token_ids, sequence_params(params, index),
                              eos_token_ids=self.tokenizer.stop_token_ids, prompt=text)
            group.requests.append(request)
            self._requests[sequence_id] = request
            self._group_of[sequence_id] = group
            self.scheduler.add(request, error)
        return group

    def abort(self, request_id: str) -> None:
        """Finish a request (every one of its n sequences) with finish_reason "abort"; its last output
        goes where its others go. An id that is unknown or finished is ignored."""
        self._check_open()
        group = self._groups.get(request_id)
        with deferred_interrupts():
            for sequence_id in [r.request_id for r in group.requests] if group is not None else [request_id]:
                self.scheduler.abort(sequence_id)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, step() has an output it has not handed back, or part of an
        applied step is still to be completed."""
        self._check_open()
        pending = self._pending
        return (self.scheduler.has_unfinished() or bool(self._step_inbox) or bool(self._unreported)
                or bool(self._unsettled)
                or (pending is not None and not all(r.is_finished for r in pending.batch.requests)))

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, run the model's loops once, update. Returns an output for every
        request added with add_request() that advanced or finished since the last step(), this one's
        included (a generate() or stream() in progress may have advanced them); the requests of a
        generate() or stream() go to that call. If the outputs never reach the caller (an exception while
        building them, KeyboardInterrupt included), the next step() hands them out. Under async scheduling
        (the CUDA default) the next step is already running when this returns."""
        self._check_open()
        self._advance()
        return self._hand_out_all(self._step_inbox)

    def _advance(self) -> None:
        """One iteration, its outputs put in the inboxes of the calls that own them. If they are not
        delivered (a failure after the step applied, KeyboardInterrupt included), its finished requests come
        back from the next iteration."""
        try:
            touched = self._step()
            with deferred_interrupts():
                self._deliver(touched)
                self._handed_back = []
        except BaseException:
            self._requeue_handed_back()
            raise

    def _step(self) -> list[Request]:
        """One iteration; the requests that advanced or finished in it, after those finished earlier whose
        outputs never reached a caller. Outputs are built by the caller, only for the requests it hands out;
        a caller that fails to deliver them calls _requeue_handed_back().

        A step is decided, then applied in full. schedule() and the commit run with Ctrl-C deferred
        (runner/interrupts.py), and the commit is safe for any exception besides: until the point of no
        return (the scheduler has decided every row's outcome and the runner's undo record is taken), a
        failure applies nothing, and the runner undoes what its run changed (seeded generators, loop
        counters); after it, every part of the application runs whatever an earlier part raised, a part that
        raised is resumed before the next step runs (_run_parts, _settle), what the step touched is handed
        back, and only then is the first exception raised. So no finished output is lost and no seeded
        request samples with a generator out of step with its tokens. What schedule() decided (admissions,
        block allocations, preemptions) stands: each is a consistent state that the next schedule() starts
        from, and none changes a request's tokens, text or logprobs. A failure of one request (its sampling,
        its detokenizing) finishes it alone with finish_reason "error"."""
        self._handed_back = []
        with deferred_interrupts():
            self._settle()
        if self.engine_config.overlaps_steps:
            return self._step_overlapped()
        with deferred_interrupts():
            batch = self.scheduler.schedule()
        return self._run_now(batch)

    def _run_now(self, batch: ScheduledBatch, touched: list[Request] | None = None) -> list[Request]:
        """Run the batch, wait for its tokens and apply it (the synchronous step); hand back what it touched,
        after `touched` (an earlier part of this step's)."""
        result = None
        if batch.requests:
            try:
                result = self.runner.run(batch)
            except BaseException:
                self.runner.rollback()
                raise
        try:
            with deferred_interrupts():
                return self._commit(batch, result, touched or [])
        except BaseException:  # before the point of no return: nothing applied; after it: rollback is a no-op
            self.runner.rollback()
            self._requeue_handed_back()
            raise

    def _step_overlapped(self) -> list[Request]:
        """Async scheduling: schedule and launch the next step before waiting for this one's tokens, so the
        host's work (this step's update and outputs, the next one's scheduling and inputs) runs while the
        device computes. The next step's rows whose last token is still on the device read it there
        (runner/model_runner.py); the scheduler applies a launched step provisionally (advance) and then
        with its tokens (resolve), with update()'s rules, so each request gets the tokens the synchronous
        path gives it. A step whose rows read their tokens on the host (penalties, logprobs, traces) runs
        synchronously once the one ahead of it is resolved. step() hands back what the step it resolves
        touched: the same step it would synchronously, one more already running behind it."""
        if self._pending is None:
            with deferred_interrupts():
                batch = self.scheduler.schedule()
            if not (batch.requests and self._launchable(batch)):
                return self._run_now(batch)
            launched = self.runner.launch(batch)
            try:
                with deferred_interrupts():
                    self._advance_launched(launched)
            except BaseException:  # not applied (once it is, it is the pending step, and kept)
                if self._pending is not launched:
                    self.runner.drop(launched)
                raise
        pending = self._pending
        with deferred_interrupts():
            batch = self.scheduler.schedule()
        launched = self.runner.launch(batch, pending) if batch.requests and self._launchable(batch) else None
        try:
            with deferred_interrupts():
                touched = self._resolve(pending)
                if launched is not None:
                    self._advance_launched(launched)
        except BaseException:  # what was resolved is handed back by the next step (Engine._advance)
            if launched is not None and self._pending is not launched:
                self.runner.drop(launched)
            raise
        if launched is None and batch.requests:  # run it now, without the rows whose requests just finished
            return self._run_now(batch.without_finished(), touched)
        return touched

    @staticmethod
    def _launchable(batch: ScheduledBatch) -> bool:
        """Can the batch run ahead of its tokens? Not where a row reads tokens or logits on the host."""
        if batch.draft_lens:
            return False
        for request in batch.requests:
            p = request.params
            if p.penalized or p.logprobs is not None or p.prompt_logprobs is not None or p.loop_trace:
                return False
        return True

    def _advance_launched(self, launched: LaunchedStep) -> None:
        """Apply a launched step provisionally (its tokens pending) and make it the one to resolve next; once
        decided, it is the pending step whatever applying it raises (the rest is resumed by _settle)."""
        batch = launched.batch
        # Rows of requests that finished meanwhile (a stop in the step before) ran for nothing: not counted,
        # as the synchronous path never runs them.
        skipped = set(launched.result.errors) | {row for row, r in enumerate(batch.requests) if r.is_finished}
        decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
        decision = self.scheduler.decide_advance(batch, launched.result.errors)
        self._pending = launched  # the point of no return
        self._count_tokens(batch, skipped, decode)
        error = self._run_parts([functools.partial(self.scheduler.apply, decision)])
        if error is not None:
            raise error

    def _resolve(self, launched: LaunchedStep) -> list[Request]:
        """Wait for a launched step's tokens and apply them; hand back the requests it advanced or
        finished."""
        result = self.runner.finish(launched)
        batch = launched.batch
        waiting = [r for r, samples in zip(batch.requests, batch.sample) if samples and r.pending]
        decision = self.scheduler.decide_pending(batch, result.tokens)
        self._pending = None  # the point of no return
        error = self._run_parts([functools.partial(self.scheduler.apply, decision),
                                 functools.partial(self.runner.commit, result, launched.staged,
                                                   decision.appended, decision.advances)])
        return self._conclude([r for r in waiting if not r.pending], self.scheduler.take_finished(), error)

    def _commit(self, batch: ScheduledBatch, result: StepResult | None,
                touched: list[Request]) -> list[Request]:
        """Apply the step and hand back the requests it advanced or finished, after `touched`. Deciding every
        row's outcome changes nothing; once the runner's undo record is taken, the step is applied in full
        (_run_parts)."""
        if result is None:
            return self._conclude(touched, self.scheduler.take_finished())
        decode = [r.num_computed_tokens >= r.num_prompt_tokens for r in batch.requests]
        before = [r.num_tokens for r in batch.requests]
        decision = self.scheduler.decide(batch, result.tokens, result.errors,
                                         {row: a for row, (_, a) in result.drafts.items()})
        staged = self.runner.take_staged()  # the point of no return
        self._count_tokens(batch, set(result.errors), decode)
        error = self._run_parts([functools.partial(self.scheduler.apply, decision),
                                 functools.partial(self.runner.commit, result, staged, decision.appended,
                                                   decision.advances)])
        advanced = [r for r, n in zip(batch.requests, before) if r.num_tokens > n or r.is_finished]
        return self._conclude(touched + advanced, self.scheduler.take_finished(), error)

    def _count_tokens(self, batch: ScheduledBatch, skip: set[int], decode: list[bool]) -> None:
        """Count the step's prompt and decode tokens, but for the rows in `skip`; decode[row]: was the row a
        decode row before the step."""
        for row, (is_decode, num_new) in enumerate(zip(decode, batch.num_new_tokens)):
            if row not in skip:
                if is_decode:
                    self.num_decode_tokens += num_new
                else:
                    self.num_prefill_tokens += num_new

    def _run_parts(self, parts: list[Callable[[], None]],
                   error: BaseException | None = None) -> BaseException | None:
        """Run every part of an applied step, each whatever an earlier one raised. A part that raises is kept
        to be resumed before the next step (_settle); each part is safe to run again (Scheduler.apply and
        ModelRunner.commit skip what they have taken on; a release repeats nothing). Returns the first
        exception, `error` if one came before."""
        for part in parts:
            try:
                part()
            except BaseException as err:
                self._unsettled.append(part)
                error = err if error is None else error
        return error

    def _settle(self) -> None:
        """Resume the parts of an applied step that raised, before anything else runs (KV blocks, seeded
        generators and outputs are then as if nothing had); one that raises again stays, and is raised."""
        parts, self._unsettled = self._unsettled, []
        error = self._run_parts(parts)
        if error is not None:
            raise error

    def _conclude(self, touched: list[Request], finished: list[Request],
                  error: BaseException | None = None) -> list[Request]:
        """The end of an applied step: release the finished requests, hand back the touched ones and the
        finished ones not among them, then raise `error` (what a part of the step raised) or the first
        exception of a release."""
        error = self._run_parts([functools.partial(self._release, r) for r in finished], error)
        seen = {id(r) for r in touched}
        handed = self._hand_back(touched + [r for r in finished if id(r) not in seen])
        if error is not None:
            raise error
        return handed

    def _release(self, request: Request) -> None:
        """A finished request gives back its runner state; its id stays in use until it has."""
        self.runner.release(request)
        self._requests.pop(request.request_id, None)

    def _hand_back(self, touched: list[Request]) -> list[Request]:
        """This step's touched requests, after those finished earlier whose outputs never reached a caller."""
        touched, self._unreported = self._unreported + touched, []
        self._handed_back = touched
        return touched

    def _deliver(self, touched: list[Request]) -> None:
        """Put the group of each request that advanced or finished into the inbox of the call that reads
        it. A request whose group is gone (its call ended and aborted it) goes nowhere."""
        for request in touched:
            group = self._group_of.get(request.request_id)
            if group is not None and request in group.requests:
                group.inbox[group.request_id] = group

    def _hand_out_all(self, inbox: Inbox) -> list[RequestOutput]:
        """Every group in the inbox as an output; the inbox is emptied only once all are built, so an
        exception while building them leaves them for the next call."""
        groups = list(inbox.values())
        outputs = [self._output(group) for group in groups]
        taken: list[tuple[SequenceGroup, bool]] = []
        try:
            with deferred_interrupts():
                for group, output in zip(groups, outputs):
                    inbox.pop(group.request_id, None)
                    if output.finished:
                        self._forget(group)
                    taken.append((group, output.finished))
        except BaseException:  # a Ctrl-C deferred to the block's end: the outputs never reach the caller
            with deferred_interrupts():
                for group, forgotten in taken:
                    if forgotten:
                        self._remember(group)
                    inbox[group.request_id] = group
            raise
        return outputs

    def _hand_out(self, group: SequenceGroup) -> RequestOutput:
        """The group's output; once it has finished, the group is forgotten (its ids become free)."""
        output = self._output(group)
        if output.finished:
            self._forget(group)
        return output

    def _forget(self, group: SequenceGroup) -> None:
        del self._groups[group.request_id]
        for request in group.requests:
            del self._group_of[request.request_id]
        group.inbox.pop(group.request_id, None)

    def _remember(self, group: SequenceGroup) -> None:
        """Undo _forget: the group's output is to be handed out again."""
        self._groups[group.request_id] = group
        for request in group.requests:
            self._group_of[request.request_id] = group

    def _output(self, group: SequenceGroup) -> RequestOutput:
        first = group.requests[0]
        params = first.params
        completions = [CompletionOutput(index, r.output_text, r.output_token_ids, r.finish_reason,
                                        r.stop_reason, r.error, list(r.traces) or None,
                                        list(r.logprobs) if params.logprobs is not None else None,
                                        r.speculative.copy() if r.speculative is not None else None)
                       for index, r in enumerate(group.requests)]
        prompt_logprobs = [None, *first.prompt_logprobs] if params.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions,
                             group.finished, first.num_cached_tokens, prompt_logprobs)

    def _requeue_handed_back(self) -> None:
        """The last _step()'s requests did not reach their inboxes: its finished ones come back next step."""
        with deferred_interrupts():
            self._unreported += [r for r in self._handed_back if r.is_finished]
            self._handed_back = []

    # -- convenience ---------------------------------------------------------------------------------

    def _prepare(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None) -> list[Prepared]:
        """Every prompt encoded and every parameter set checked, before anything is added: a bad input adds
        nothing."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        encoded = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        checked: dict[int, SamplingParams] = {}  # one checked copy per params object the call passes
        for sp in per_prompt:
            if id(sp) not in checked:
                checked[id(sp)] = self._check_params(sp)
        return [(ids, text, checked[id(sp)]) for (ids, text), sp in zip(encoded, per_prompt)]

    def _add_all(self, prepared: list[Prepared], inbox: Inbox, groups: list[SequenceGroup]) -> None:
        """Add every prepared prompt under a fresh automatic id, appending each group to `groups` as it is
        added (so an interrupted call still knows what to abort)."""
        ids = self._new_ids([params.n for _, _, params in prepared])
        for request_id, (token_ids, text, params) in zip(ids, prepared):
            groups.append(self._add(request_id, token_ids, text, params, inbox))

    def _abandon(self, groups: list[SequenceGroup]) -> None:
        """A generate() or stream() call has ended: abort and forget the groups it has not handed out, so
        none holds KV blocks or runs in a later step."""
        if self._closed:
            return
        with deferred_interrupts():
            abandoned = set()
            for group in groups:
                if self._groups.get(group.request_id) is group:
                    for request in group.requests:
                        self.scheduler.abort(request.request_id)
                        abandoned.add(id(request))
                    self._forget(group)
            if abandoned:  # released now, not at the next step, so has_unfinished() is False at once
                finished = self.scheduler.take_finished()
                self._unreported += [r for r in finished if id(r) not in abandoned]
                error = self._run_parts([functools.partial(self._release, r) for r in finished])
                if error is not None:
                    raise error

    def stream(self, prompts: Prompt | list[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Incremental outputs as they are produced: each carries every completion so far (n of them),
        and a request's last output has finished=True. Prompts and parameters are checked here; the
        requests are added when iteration starts. Leaving early (break, an exception, closing the
        generator) aborts this call's unfinished requests. Streams may interleave with each other and with
        generate(): each call gets its own requests' outputs (latest state first come, first served)."""
        self._check_open()
        return self._stream(self._prepare(prompts, sampling_params))

    def _stream(self, prepared: list[Prepared]) -> Iterator[RequestOutput]:
        inbox: Inbox = {}
        groups: list[SequenceGroup] = []
        try:
            self._add_all(prepared, inbox, groups)
            unfinished = len(groups)
            while unfinished:
                if not inbox:
                    self._advance()
                while inbox:
                    output = self._hand_out(inbox.pop(next(iter(inbox))))
                    unfinished -= output.finished
                    yield output
        finally:
            self._abandon(groups)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order, each with its n completions. use_tqdm: a progress
        bar in generated tokens, with tok/s. Any early exit (an exception, KeyboardInterrupt) aborts this
        call's unfinished requests."""
        self._check_open()
        prepared = self._prepare(prompts, sampling_params)
        inbox: Inbox = {}
        groups: list[SequenceGroup] = []
        results: dict[str, RequestOutput] = {}
        progress = None
        try:
            self._add_all(prepared, inbox, groups)
            if use_tqdm:
                progress = TokenProgress(groups, self.max_model_len, self.num_prefill_tokens)
            while len(results) < len(groups):
                if not inbox:
                    self._advance()
                for group in _take_all(inbox):
                    if progress is not None:
                        progress.advance(group)
                    if group.finished:
                        results[group.request_id] = self._hand_out(group)
                if progress is not None:
                    progress.show_prompt_rate(self.num_prefill_tokens)
        finally:
            self._abandon(groups)
            if progress is not None:
                progress.close()
        return [results[group.request_id] for group in groups]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with `chat_template` (a jinja2 string), else the checkpoint's chat
        template, else ChatML, then generate. chat_template_kwargs: extra variables for the template."""
        self._check_open()
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
            raise ValueError(f"chat_template must be a non-empty string (a jinja2 template), "
                             f"got {chat_template!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, "
                             f"got {type(chat_template_kwargs).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt, chat_template=chat_template,
                    **(chat_template_kwargs or {})))
            except ValueError as err:
                raise ValueError(f"conversation {i}: {err}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer: encode, decode, apply_chat_template, stop_token_ids."""
        self._check_open()
        return self.tokenizer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine is closed")

    def __getattr__(self, name: str) -> Any:
        # Reached only when an attribute is missing: after close() every instance attribute is.
        if self._closed and not name.startswith("__"):
            raise RuntimeError("Engine is closed")
        raise AttributeError(f"'Engine' object has no attribute {name!r}")

    def close(self) -> None:
        """Free the model, the KV pool (device memory included) and the rest of the engine's state; any
        later use raises RuntimeError("Engine is closed"). Closing twice does nothing."""
        if self._closed:
            return
        cuda = self.device.type == "cuda"
        self.__dict__.clear()
        self._closed = True
        gc.collect()
        if cuda:
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


def available_memory_bytes() -> int | None:
    """Host memory available to this process now: Linux's MemAvailable, within a cgroup v2 memory limit
    when one is set; where /proc is missing, the free pages the OS reports; None where it reports none."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    available = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    if available is None:  # kernels before 3.14
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, max(0, int(limit) - used))


def device_memory_available(device: torch.device) -> int | None:
    """Bytes a new allocation may take on the device now: CUDA's free memory, or the host's available
    memory (available_memory_bytes); None where the OS does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()


LLM = Engine  # vLLM's name: `from engine import LLM`


class TokenProgress:
    """generate()'s progress bar, in generated tokens (tqdm shows tok/s). Its total starts at the most each
    request may generate (n x max_tokens, capped by max_model_len) and drops by what a request leaves unused
    when it finishes, so the bar moves with the tokens and ends at 100%."""

    def __init__(self, groups: list[SequenceGroup], max_model_len: int, prompt_tokens: int) -> None:
        """prompt_tokens: the engine's count of prompt tokens computed so far, for the prompt tok/s."""
        self.budget = {g.request_id: sum(_token_budget(r, max_model_len) for r in g.requests) for g in groups}
        self.counted = dict.fromkeys(self.budget, 0)
        self.bar = progress_bar_class()(total=sum(self.budget.values()), desc="generating", unit="tok",
                                        dynamic_ncols=True)
        self.start, self.prompt_tokens0 = time.perf_counter(), prompt_tokens

    def advance(self, group: SequenceGroup) -> None:
        done = sum(r.num_output_tokens for r in group.requests)
        new = done - self.counted[group.request_id]
        self.counted[group.request_id] = done
        if group.finished:
            self.bar.total -= self.budget[group.request_id] - done
        self.bar.update(new)

    def show_prompt_rate(self, prompt_tokens: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"prompt {(prompt_tokens - self.prompt_tokens0) / elapsed:.0f} tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def _token_budget(request: Request, max_model_len: int) -> int:
    room = max(max_model_len - request.num_prompt_tokens, 0)
    return room if request.params.max_tokens is None else min(request.params.max_tokens, room)


def progress_bar_class() -> type:
    """tqdm's notebook widget inside a Jupyter kernel that has ipywidgets, else the plain text bar: without
    ipywidgets, tqdm.auto warns ("IProgress not found") and draws no widget."""
    ipython = sys.modules.get("IPython")  # a Jupyter kernel has imported it; a script need not
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and "IPKernelApp" in getattr(shell, "config", {}) \
            and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    return tqdm


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


# -- CLI -------------------------------------------------------------------------------------------

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
                        help="full (default), threshold:Q, step:K (0-based), weighted, or early:Q (stops "
                             "looping a generated token once its exit CDF reaches Q)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3",
                                                                     *KVARN_PRESETS],
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
                  kv_sharing=args.kv_sharing, max_model_len=args.max_model_len,
                  num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
                  speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                  admission=args.admission, kv_cache_dtype=args.kv_cache_dtype,
                  kv_sink_tokens=args.kv_sink_tokens, kv_tail_tokens=args.kv_tail_tokens,
                  kv_rotation=not args.kv_no_rotation,
                  block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                  async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                  piecewise_graph_tokens=args.piecewise_graph_tokens, max_num_seqs=args.max_num_seqs,
                  deterministic={"auto": None, "on": True, "off": False}[args.deterministic],
                  check_finite_weights=not args.no_check_finite_weights)


def cli_serve(args: argparse.Namespace) -> int:
    """Run `serve`: the Engine of the engine flags behind server/app.py's server, until SIGTERM or Ctrl-C.
    The server sits above the engine (the design's cli.py will hold this); this is the one place that
    reaches up to it."""
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
