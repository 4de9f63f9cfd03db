"""Turns a scheduled batch into tensors once per step, runs every loop of the model over it through
the attention backend, and samples the next tokens."""

from __future__ import annotations

from typing import Callable

import torch

from attention.base import AttentionBackend, AttentionMetadata
from cache.shared_kv import SharedKVLayout
from model.cuda_graph import DecodeGraphs
from model.kernels.gemv import reserve_workspace
from model.early_exit import EarlyExit
from model.exit_policy import FULL, ExitPolicy, readout_logits, request_policy
from model.ouro import LoopStates, OuroForCausalLM
from model.sampler import logprob_dicts, logprobs_topn, sample
from scheduler.request import Request
from scheduler.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: OuroForCausalLM, backend: AttentionBackend, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        # Set by the Engine (issue 6): the engine-wide exit policy, its compute-saving driver for early:Q,
        # and the KV layout under kv_sharing="last". Both of the latter run eagerly (no graphs).
        self.exit_policy: ExitPolicy = FULL
        self.early_exit: EarlyExit | None = None
        self.shared_kv: SharedKVLayout | None = None
        self.token_text: Callable[[int], str] | None = None  # set by the Engine: Logprob.decoded_token

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                      list[int]]:
        """Flatten the batch: token ids, positions, slot mapping, per-row lengths and block tables."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        readout: list[int] = []
        prompt_readout: list[int] = []  # tokens whose next prompt token's logprob is asked for, after readout
        for request, num_new, samples in zip(batch.requests, batch.num_new_tokens, batch.sample):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids += request.token_ids[start:end]
            positions += range(start, end)
            table = request.block_table
            slot_mapping += (self.shared_kv.slot_mapping(request, start, end) if self.shared_kv is not None
                             else [table[p // bs] * bs + p % bs for p in range(start, end)])
            query_start.append(query_start[-1] + num_new)
            context_lens.append(end)
            if samples:
                readout.append(query_start[-1] - 1)
            first = query_start[-2] - start
            prompt_readout += [first + p for p in prompt_logprob_positions(request, start, end)]
        width = max(len(r.block_table) for r in batch.requests)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in batch.requests]
        meta = AttentionMetadata(
            query_start_loc=self._tensor(query_start),
            context_lens=self._tensor(context_lens),
            block_tables=self._tensor(tables),
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            query_lens_cpu=list(batch.num_new_tokens),
            context_lens_cpu=context_lens,
            block_size=bs,
            shared_kv=self.shared_kv.metadata(batch) if self.shared_kv is not None else None,
        )
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                readout + prompt_readout)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                readout: list[int]) -> LoopStates:
        """All loops over the batch: a captured graph for decode steps that fit a bucket, else eager."""
        if (self.graphs is not None and meta.is_decode and self.graphs.bucket_for(meta.num_rows) is not None
                and len(readout) == meta.num_rows):  # a graph reads out every row, in order
            return self.graphs.replay(input_ids, positions, meta)
        self.backend.prepare(meta)
        return self.model(input_ids, positions, self.backend.forward, self._tensor(readout, torch.int64))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """The next token of every request whose chunk reaches the end of its sequence, else None. Logprobs
        asked for by SamplingParams(logprobs, prompt_logprobs) are appended to the requests."""
        input_ids, positions, meta, readout = self.prepare(batch)
        if self.early_exit is not None:
            states = self.early_exit.forward(batch, input_ids, positions, meta, readout)
        else:
            states = self.forward(input_ids, positions, meta, readout)
        sampling = [r for r, samples in zip(batch.requests, batch.sample) if samples]
        if len(readout) > len(sampling):
            self._attach_prompt_logprobs(batch, LoopStates(states.hidden[:, len(sampling):],
                                                           states.gate_logits[:, len(sampling):]))
        if not sampling:
            return [None] * len(batch.requests)
        loops = self.model.config.total_ut_steps
        policies = [request_policy(r.params.exit_policy, self.exit_policy, loops) for r in sampling]
        logits, traces = readout_logits(self.model.compute_logits, states.hidden[:, :len(sampling)],
                                        states.gate_logits[:, :len(sampling)], policies,
                                        [r.params.loop_trace for r in sampling])
        for request, trace in zip(sampling, traces):
            if trace is not None:
                request.traces.append(trace)
        sampled = sample(logits, [r.params for r in sampling], [self._generator(r) for r in sampling])
        self._attach_logprobs(sampling, logits, sampled)
        tokens = iter(sampled.tolist())
        return [next(tokens) if samples else None for samples in batch.sample]

    def _attach_logprobs(self, sampling: list[Request], logits: torch.Tensor, sampled: torch.Tensor) -> None:
        """SamplingParams(logprobs=N): the sampled token's logprob and the top N, appended to the request."""
        rows = [i for i, r in enumerate(sampling) if r.params.logprobs is not None]
        if not rows:
            return
        counts = [sampling[i].params.logprobs for i in rows]
        top = logprobs_topn(logits[rows], sampled[rows], max(counts))
        for i, entry in zip(rows, logprob_dicts(top, counts, self.token_text)):
            sampling[i].logprobs.append(entry)

    def _attach_prompt_logprobs(self, batch: ScheduledBatch, states: LoopStates) -> None:
        """SamplingParams(prompt_logprobs=N): each prompt token's logprob given the tokens before it, read out
        under the request's exit policy from the states of the prompt readout tokens (prepare's order)."""
        loops = self.model.config.total_ut_steps
        requests, next_tokens = [], []
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            for p in prompt_logprob_positions(request, start, start + num_new):
                requests.append(request)
                next_tokens.append(request.prompt_token_ids[p + 1])
        policies = [request_policy(r.params.exit_policy, self.exit_policy, loops) for r in requests]
        logits, _ = readout_logits(self.model.compute_logits, states.hidden, states.gate_logits, policies,
                                   [False] * len(requests))
        counts = [r.params.prompt_logprobs for r in requests]
        top = logprobs_topn(logits, torch.tensor(next_tokens, device=logits.device), max(counts))
        for request, entry in zip(requests, logprob_dicts(top, counts, self.token_text)):
            request.prompt_logprobs.append(entry)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, scratch_block: int) -> None:
        """Capture one graph per decode bucket; decode steps replay them from then on."""
        if self.model.fused_kernels:
            reserve_workspace(self.device)  # the skinny GEMM's split-K tickets, made outside any capture
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, max_blocks, self.block_size,
                              scratch_block, self.device)
        graphs.capture_all()
        self.graphs = graphs

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.seed is None or request.params.greedy:
            return None
        if request.request_id not in self.generators:
            generator = torch.Generator(self.device).manual_seed(request.params.seed)
            self.generators[request.request_id] = generator
        return self.generators[request.request_id]

    def release(self, request: Request) -> None:
        self.generators.pop(request.request_id, None)


def prompt_logprob_positions(request: Request, start: int, end: int) -> range:
    """Positions in [start, end) whose logits give a prompt token's logprob (position p predicts token p + 1)
    and that are not recorded yet (a preempted request recomputes its prompt)."""
    if request.params.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(request.prompt_logprobs)), min(end, request.num_prompt_tokens - 1))
