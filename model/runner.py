"""Turns a scheduled batch into tensors once per step, runs every loop of the model over it through
the attention backend, and samples the next tokens."""

from __future__ import annotations

import torch

from attention.base import AttentionBackend, AttentionMetadata
from cache.shared_kv import SharedKVLayout
from model.cuda_graph import DecodeGraphs
from model.kernels.gemv import reserve_workspace
from model.early_exit import EarlyExit
from model.exit_policy import FULL, ExitPolicy, readout_logits, request_policy
from model.ouro import LoopStates, OuroForCausalLM
from model.sampler import sample
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
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, readout

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                readout: list[int]) -> LoopStates:
        """All loops over the batch: a captured graph for decode steps that fit a bucket, else eager."""
        if self.graphs is not None and meta.is_decode and self.graphs.bucket_for(meta.num_rows) is not None:
            return self.graphs.replay(input_ids, positions, meta)
        self.backend.prepare(meta)
        return self.model(input_ids, positions, self.backend.forward, self._tensor(readout, torch.int64))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """The next token of every request whose chunk reaches the end of its sequence, else None."""
        input_ids, positions, meta, readout = self.prepare(batch)
        if self.early_exit is not None:
            states = self.early_exit.forward(batch, input_ids, positions, meta, readout)
        else:
            states = self.forward(input_ids, positions, meta, readout)
        sampling = [r for r, samples in zip(batch.requests, batch.sample) if samples]
        if not sampling:
            return [None] * len(batch.requests)
        loops = self.model.config.total_ut_steps
        policies = [request_policy(r.params.exit_policy, self.exit_policy, loops) for r in sampling]
        logits, traces = readout_logits(self.model.compute_logits, states.hidden, states.gate_logits,
                                        policies, [r.params.loop_trace for r in sampling])
        for request, trace in zip(sampling, traces):
            if trace is not None:
                request.traces.append(trace)
        tokens = iter(sample(logits, [r.params for r in sampling],
                             [self._generator(r) for r in sampling]).tolist())
        return [next(tokens) if samples else None for samples in batch.sample]

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
