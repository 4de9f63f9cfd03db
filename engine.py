"""loop-engine's Python API: Engine, in vLLM's shape. `python engine.py generate|eval|serve` runs the command
line (cli.py).

    from engine import Engine, SamplingParams
    with Engine() as engine:                     # the embedded tiny checkpoint, offline
        out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from attention.registry import select
from cache.blocks import BlockManager
from cache.kv_format import PoolShape
from cache.kv_pool import KVPool
from cache.layout import KV_SHARING, KVCapacity, make_layout
from cache.pool_sizing import PoolSizer
from cache.side_rows import SideRows
from engine_config import EngineConfig
from exit_policy import ExitPolicy
from model.registry import load_model
from model.tokenizer import Tokenizer
from outputs import Inbox, OutputBook, SequenceGroup, TokenProgress, sequence_ids, sequence_params, take_all
from request import Request, RequestOutput, SamplingParams, SpeculativeStats
from request_checks import checked_params, request_loops
from runner.interrupts import deferred_interrupts
from runner.loop_driver import EagerLoops, LoopStats, StepInputs, run_loops
from runner.model_runner import ModelRunner
from scheduler.scheduler import KV_POOL_FULL, Scheduler
from stepping import OverlappedStepper, SyncStepper

__all__ = ["Engine", "LLM", "SamplingParams", "RequestOutput", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parent / "model" / "checkpoints" / "tiny-ouro"
# A prompt as vLLM takes it: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
Prepared = tuple[list[int], str | None, SamplingParams]  # a prompt's token ids, its text, its checked params


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in value)


class Engine:
    """One model, one KV pool, one scheduler. Not thread-safe; one process, one device.

    Construction resolves and validates every option once (engine_config.EngineConfig), then builds each
    component from that frozen config: attention backend, model, KV pool (its format's, sized to memory) and
    layout, block manager, scheduler, the step runner (which captures CUDA graphs on CUDA), and the way it
    steps, synchronous or overlapped (stepping.py), chosen once."""

    _closed = False

    def __init__(self, model: str | Path | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", attention: str = "auto", loops: int | None = None,
                 exit_threshold: float | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_gib: float | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 packed_prefill: bool = False, enforce_eager: bool = False,
                 exit_policy: str | None = None, kv_sharing: str = "none", kv_layout: str | None = None,
                 speculative: str | None = None,
                 num_speculative_tokens: int | None = None, admission: str = "reserve",
                 kv_cache_dtype: str = "auto", kv_sink_tokens: int = 0, kv_tail_tokens: int = 0,
                 kv_rotation: bool = True, async_scheduling: bool | None = None,
                 piecewise_graph_tokens: int = 512, deterministic: bool | None = None,
                 check_finite_weights: bool = True, init_scale: float | None = None,
                 continuous_compute: str | None = None, depth_batching: bool = False,
                 passes_per_step: int | None = None, verbose: bool = True) -> None:
        if not isinstance(verbose, bool):
            raise ValueError(f"verbose must be True or False, got {verbose!r}")
        self.engine_config = config = EngineConfig.resolve(
            model if model is not None else DEFAULT_MODEL, device, dtype, loops, exit_threshold, exit_policy,
            attention=attention, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_gib=kv_cache_gib, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            packed_prefill=packed_prefill, enforce_eager=enforce_eager, kv_sharing=kv_sharing,
            kv_layout=kv_layout, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
            admission=admission,
            kv_cache_dtype=kv_cache_dtype, kv_sink_tokens=kv_sink_tokens, kv_tail_tokens=kv_tail_tokens,
            kv_rotation=kv_rotation, async_scheduling=async_scheduling,
            piecewise_graph_tokens=piecewise_graph_tokens, deterministic=deterministic,
            check_finite_weights=check_finite_weights, init_scale=init_scale,
            continuous_compute=continuous_compute, depth_batching=depth_batching,
            passes_per_step=passes_per_step)
        model_dir = config.model_dir
        self.config = config.model  # the checkpoint's config, of its family's class (model/registry.py)
        self.tokenizer = Tokenizer(model_dir)
        self.backend = select(config.attention, config.device, {"packed_prefill": config.packed_prefill,
                                                                "batch_invariant": config.batch_invariant})
        self.backend.check(config.dtype, config.model.shape.head_dim, config.device)
        layout_kind = KV_SHARING[config.kv_sharing]
        if layout_kind not in self.backend.capabilities.kv_formats:
            raise ValueError(f"kv_sharing={config.kv_sharing!r} needs the {layout_kind!r} KV format, which "
                             f"attention={self.backend.name!r} does not provide "
                             f"(it has {', '.join(self.backend.capabilities.kv_formats)})")
        self.model = load_model(model_dir, self.config, config.device, config.dtype, config.batch_invariant,
                                check_finite=config.check_finite_weights)
        # In deterministic mode a generated token's K/V stands for a prompt's (in the prefix cache, in a
        # recompute) only where the backend gives a prompt token what decoding it gives.
        exact = config.generated_kv_exact and (not config.batch_invariant
                                               or self.backend.capabilities.prefill_matches_decode)
        self.layout = make_layout(config.layout_name, self.model.slot_map, config.block_size, exact)
        # The slots the layout keeps are those the model's attention calls use (a ring's, for compress:k).
        self.model.slot_map = self.layout.slot_map
        kv_format, shape = config.kv_format, self._pool_shape()
        side_rows = kv_format.side_rows(shape)  # rows the pool keeps apart from its blocks (KVarN's), or None
        self.kv_pool, num_blocks = PoolSizer(kv_format, shape, config.device, config.num_kv_blocks,
                                             config.kv_cache_gib, config.gpu_memory_utilization,
                                             config.max_model_len).build(side_rows, self._profile_run)
        kv_format.bind(self.backend, self.kv_pool, shape.head_dim ** -0.5)
        self.num_kv_blocks = num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          layout=self.layout, side_rows=side_rows)
        if self.layout.blocks_per_sequence(config.max_model_len, 0) > num_blocks:
            warnings.warn(f"the KV pool holds {num_blocks * config.block_size} tokens, less than "
                          f"max_model_len {config.max_model_len}: a sequence that outgrows it ends with "
                          f"finish_reason 'length' and stop_reason {KV_POOL_FULL!r}. Raise kv_cache_gib or "
                          "num_kv_blocks, or lower max_model_len", stacklevel=2)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, self.tokenizer, config.speculative_tokens,
                                   config.admission, pipelined=config.pipelines_speculation,
                                   chain_positions=config.chain_positions)
        self.runner = ModelRunner(config, self.model, self.backend, self.kv_pool, self.layout,
                                  scratch_block=num_blocks, token_text=self.tokenizer.token_text,
                                  scratch_side_block=kv_format.scratch_side_block(side_rows))
        self.outputs = OutputBook()
        stepper = OverlappedStepper if config.overlaps_steps else SyncStepper
        self.stepper = stepper(self.scheduler, self.runner, self.outputs)
        self._step = self.stepper.step  # chosen once, as vLLM's step_fn
        if verbose:
            self._print_start_line(num_blocks, side_rows)

    def _pool_shape(self) -> PoolShape:
        """What the KV pool is built from (cache/kv_format.py), besides its block count."""
        config, shape = self.engine_config, self.engine_config.model.shape
        return PoolShape(self.model.slot_map, config.block_size, shape.num_key_value_heads, shape.head_dim,
                         config.dtype, config.max_num_seqs, config.kv_sink_tokens, config.kv_tail_tokens,
                         config.kv_rotation, config.batch_invariant,
                         generated_apart=config.kv_sharing == "last",
                         loop_uniform_scales=config.exit_policy.can_exit or config.kv_sharing == "last")

    def _print_start_line(self, num_blocks: int, side_rows: SideRows | None) -> None:
        config = self.engine_config
        speculation = f", speculative={config.speculative} x {config.speculative_tokens} tokens" \
            if config.speculative else ""
        kv = "" if config.kv_cache_dtype == "auto" else f", kv_cache_dtype={config.kv_cache_dtype}"
        kv += "" if config.kv_rotation else " (no rotation)"
        depth = ""
        if config.depth_batching:
            depth = ", depth_batching"
            chains = f"chains of {config.step_passes} passes a step where rows allow" \
                if config.step_passes > 1 else ""
            graphs = self.runner.depth.graphs
            chained = self.runner.speculative_chains or self.runner.chains  # the chains a step runs
            chain_graphs = chained.graphs if chained is not None else None
            if graphs is not None and graphs.captured:
                prompts = "piecewise graphs" if self.runner.piecewise is not None else "eager"
                if chains:
                    whole = "each pass one graph with the step to the next" \
                        if chain_graphs is not None and chain_graphs.captured else "eager between passes"
                    chains = f"; {chains}, {whole}"
                depth += (f" (CUDA graphs: a loop pass's layer stack, {len(graphs.buckets)} batch sizes up "
                          f"to {graphs.buckets[-1]}{chains}; otherwise eager: a token's start, exits, coda, "
                          f"readout; prompt steps: {prompts})")
            else:
                depth += f" ({chains}{'; ' if chains else ''}eager)" if config.device.type == "cuda" \
                    else f" ({chains})" if chains else ""
        print(f"loop-engine: {config.loops} loops x {self.model.slot_map.loop_layers} layers, "
              f"{config.dtype}{kv}, {config.device}, attention={self.backend.name}, "
              f"exit_policy={config.exit_policy}{speculation}{depth}; "
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
    def loops(self) -> int:
        """The loops a token runs at most: the Engine's `loops`, else the checkpoint's (Ouro's total_ut_steps,
        Huginn's mean_recurrence)."""
        return self.engine_config.loops

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens computed since the engine started (a recomputed one again)."""
        return self.stepper.num_prefill_tokens

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens computed since the engine started."""
        return self.stepper.num_decode_tokens

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.uses_cuda_graphs

    @property
    def loop_stats(self) -> LoopStats:
        """Decode tokens and the loops they ran (fewer than loops x tokens under early:Q and the exit
        criteria)."""
        return self.runner.loop_stats

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Under speculative decoding, every request's drafts since the engine started: made and accepted,
        per draft position and overall (None without speculation)."""
        return self.runner.speculation.stats if self.runner.speculation is not None else None

    @property
    def kv_capacity(self) -> KVCapacity:
        """What the KV layout buys: bytes per token, tokens per GiB and their gain over the full layout, and
        the tokens the pool holds (cache/layout.py)."""
        return self.layout.capacity(self.kv_pool, self.num_kv_blocks)

    def max_concurrent_sequences(self, prompt_tokens: int, generated_tokens: int) -> int:
        """How many sequences of this shape the KV pool holds at once (kv_sharing="last" stores a generated
        token in 1/loops of a prompt token's bytes; a KVarN pool's side rows may hold fewer)."""
        return self.layout.max_concurrent_sequences(self.block_manager.num_blocks, prompt_tokens,
                                                    generated_tokens, self.block_manager.side_rows)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step (max_num_batched_tokens tokens) once, for the activation peak that the KV pool
        leaves room for on CUDA (cache/pool_sizing.py)."""
        config = self.engine_config
        device, num_tokens = config.device, config.max_num_batched_tokens
        try:
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
            positions = torch.arange(num_tokens, device=device)
            inputs = StepInputs(ids, positions, None, torch.arange(min(num_tokens, 256), device=device), [])
            executor = EagerLoops(self.model, None, lambda q, k, v, slot: q.clone())  # no KV: nothing stored
            states = run_loops(executor, self.model, inputs, range(config.loops))
            self.model.compute_logits(states.hidden[-1])
            del states
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            raise ValueError(f"max_num_batched_tokens={num_tokens}: a step of that many tokens does not fit "
                             f"in {device}'s memory beside the weights; lower it") from None

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
            request_id = self.outputs.new_ids([params.n])[0]
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        elif not self.outputs.id_is_free(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._add(request_id, token_ids, text, params, self.outputs.step_inbox).request_id

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy of the params, which the request keeps (request_checks.py)."""
        return checked_params(params, self.engine_config, self.model.exit_gate is not None, self._dense_kv)

    def request_loops(self, params: SamplingParams) -> int:
        """The loops a request with these params runs (request_checks.py: request_loops)."""
        return request_loops(params, self.engine_config, self._dense_kv)

    @property
    def _dense_kv(self) -> bool:
        return isinstance(self.kv_pool, KVPool)

    def _add(self, request_id: str, token_ids: list[int], text: str | None, params: SamplingParams,
             inbox: Inbox) -> SequenceGroup:
        """Queue the request's n sequences (ids checked by the caller); `inbox` gets its outputs."""
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        error = f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {self.config.vocab_size})" \
            if bad else None
        group = self.outputs.open_group(request_id, inbox)
        for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
            own = sequence_params(params, index)
            request = Request(sequence_id, token_ids, own, eos_token_ids=self.tokenizer.stop_token_ids,
                              prompt=text, state_seed=self._state_seed(own))
            self.outputs.track(group, request)
            self.scheduler.add(request, error)
        return group

    def _state_seed(self, params: SamplingParams) -> int | None:
        """The seed of a sequence's drawn initial states (runner/initial_states.py), where the model draws
        them: its SamplingParams.seed, else a random one drawn now from torch's global RNG (as vLLM samples
        an unseeded request), so its states stay the same through preemption and recompute."""
        if not self.engine_config.draws_initial_states:
            return None
        if params.seed is not None:
            return params.seed
        return int(torch.randint(0, 2**63 - 1, ()))

    def abort(self, request_id: str) -> None:
        """Finish a request (every one of its n sequences) with finish_reason "abort"; its last output
        goes where its others go. An id that is unknown or finished is ignored."""
        self._check_open()
        group = self.outputs.groups.get(request_id)
        with deferred_interrupts():
            for sequence_id in [r.request_id for r in group.requests] if group is not None else [request_id]:
                self.scheduler.abort(sequence_id)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, step() has an output it has not handed back, or part of an
        applied step is still to be completed."""
        self._check_open()
        return self.scheduler.has_unfinished() or self.outputs.has_unread() or self.stepper.busy()

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, run the model's loops once, update. Returns an output for every
        request added with add_request() that advanced or finished since the last step(), this one's
        included (a generate() or stream() in progress may have advanced them); the requests of a
        generate() or stream() go to that call. If the outputs never reach the caller (an exception while
        building them, KeyboardInterrupt included), the next step() hands them out. Under async scheduling
        (the CUDA default) the next step is already running when this returns."""
        self._check_open()
        self._advance()
        return self.outputs.hand_out_all(self.outputs.step_inbox)

    def _advance(self) -> None:
        """One iteration, its outputs put in the inboxes of the calls that own them. If they are not
        delivered (a failure after the step applied, KeyboardInterrupt included), its finished requests come
        back from the next iteration."""
        try:
            touched = self._step()
            with deferred_interrupts():
                self.outputs.deliver(touched)
                self.outputs.handed_back = []
        except BaseException:
            self.outputs.requeue_handed_back()
            raise

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
        ids = self.outputs.new_ids([params.n for _, _, params in prepared])
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
                if self.outputs.groups.get(group.request_id) is group:
                    for request in group.requests:
                        self.scheduler.abort(request.request_id)
                        abandoned.add(id(request))
                    self.outputs.forget(group)
            if abandoned:  # released now, not at the next step, so has_unfinished() is False at once
                finished = self.scheduler.take_finished()
                self.outputs.unreported += [r for r in finished if id(r) not in abandoned]
                error = self.stepper.run_parts([functools.partial(self.stepper.release, r) for r in finished])
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
                    output = self.outputs.hand_out(inbox.pop(next(iter(inbox))))
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
                for group in take_all(inbox):
                    if progress is not None:
                        progress.advance(group)
                    if group.finished:
                        results[group.request_id] = self.outputs.hand_out(group)
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


LLM = Engine  # vLLM's name: `from engine import LLM`


if __name__ == "__main__":  # `python engine.py generate ...`: the command line is cli.py's
    from cli import main

    sys.exit(main())
