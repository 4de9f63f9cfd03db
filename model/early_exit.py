"""early:Q, the exit policy that saves compute (docs/looped_controls.md): a generated token stops looping at
the first loop whose exit CDF reaches Q, and later loops run on fewer rows.

Prompt rows (prefill chunks) run every loop, as the paper keeps full per-loop K/V for the prompt. Decode rows
(one generated token each; the scheduler replays recomputed generated tokens one per step) run loop by
loop; after each loop the rows whose CDF reached Q leave the batch, and the next loop runs over the rest
with metadata rebuilt for them, so it really costs less. An exited token's deeper (loop, layer) slots get
its last computed loop's K/V (copy-forward), so later tokens attend to it at every loop; under
kv_sharing="last" its shared slot already holds that loop's K/V and no copy is needed.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from attention.base import AttentionBackend, AttentionMetadata
from model.ouro import LoopStates, OuroForCausalLM
from scheduler.scheduler import ScheduledBatch


@dataclasses.dataclass(slots=True)
class EarlyExitStats:
    """Loops run by decode tokens (generated tokens fed back in), summed since the engine started."""

    decode_tokens: int = 0
    decode_loops: int = 0

    @property
    def loops_per_token(self) -> float:
        return self.decode_loops / self.decode_tokens if self.decode_tokens else math.nan


def select_rows(meta: AttentionMetadata, rows: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of a subset of the batch's rows (in order) and the indices of their tokens."""
    device = meta.query_start_loc.device
    starts = _starts(meta.query_lens_cpu)
    tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]).to(device)
    query_lens = [meta.query_lens_cpu[r] for r in rows]
    query_start = _starts(query_lens)
    index = torch.tensor(rows, device=device)
    sub = dataclasses.replace(
        meta, query_start_loc=torch.tensor(query_start, dtype=meta.query_start_loc.dtype, device=device),
        context_lens=meta.context_lens[index], block_tables=meta.block_tables[index],
        slot_mapping=meta.slot_mapping[tokens], query_lens_cpu=query_lens,
        context_lens_cpu=[meta.context_lens_cpu[r] for r in rows],
        shared_kv=meta.shared_kv.select(rows) if meta.shared_kv is not None else None)
    return sub, tokens


def constant_gate_bias(exit_loop: int, q: float) -> float:
    """The gate bias that, with a zero gate weight (lambda constant for every token), makes early:q exit every
    generated token after loop `exit_loop` (0-based): CDF(t) = 1 - (1 - lambda)^(t+1) first reaches q there.
    For benchmarks and tests that need a known exit pattern from random weights."""
    if not 0.0 < q < 1.0 or exit_loop < 0:
        raise ValueError(f"need 0 < q < 1 and exit_loop >= 0, got q={q!r}, exit_loop={exit_loop!r}")
    lam = 1.0 - (1.0 - q) ** (1.0 / (exit_loop + 0.5))  # halfway (in log survival) between two loops
    return math.log(lam / (1.0 - lam))


def force_exit_loop(model: OuroForCausalLM, exit_loop: int, q: float) -> None:
    """Zero the exit gate's weight and set its bias to constant_gate_bias(exit_loop, q), in place."""
    with torch.no_grad():
        model.early_exit_gate.weight.zero_()
        model.early_exit_gate.bias.fill_(constant_gate_bias(exit_loop, q))


def _starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def copy_forward(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, loop: int,
                 num_layers: int) -> None:
    """Every layer's slots of loops > `loop` get the tokens' loop-`loop` K/V. slots: [n] in-plane indices."""
    for cache in (key_cache, value_cache):
        planes = cache.view(-1, num_layers, cache.shape[1] * cache.shape[2], *cache.shape[3:])
        planes[loop + 1:, :, slots] = planes[loop, :, slots].unsqueeze(0)


class EarlyExit:
    def __init__(self, model: OuroForCausalLM, backend: AttentionBackend, threshold: float,
                 kv_sharing: bool) -> None:
        self.model = model
        self.backend = backend
        self.threshold = threshold
        self.kv_sharing = kv_sharing  # the shared slot already holds the last loop run: no copy-forward
        self.stats = EarlyExitStats()

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, readout: list[int]) -> LoopStates:
        """Loop states of the readout tokens, as OuroForCausalLM.forward gives them; a row that exited
        repeats its exit loop's hidden state in later loops and has NaN gate logits there."""
        model, loops = self.model, self.model.config.total_ut_steps
        step = _Step(batch, meta, readout, input_ids.device)
        h = model.embed_tokens(input_ids)
        cos, sin = model.rotary(positions, h.dtype)
        hidden = h.new_empty((loops, len(step.watched), h.shape[-1]))
        gates = h.new_full((loops, len(step.watched)), math.nan)
        self.backend.prepare(meta)
        for t in range(loops):
            h = model.run_loop(h, cos, sin, self.backend.forward, t)
            states = h[step.live_rows_of_h]
            hidden[t, step.live_columns] = states
            gates[t, step.live_columns] = model.early_exit_gate(states).squeeze(-1)
            if t > 0:
                hidden[t, step.dead_columns] = hidden[t - 1, step.dead_columns]
            if t == loops - 1 or not step.looping or self.threshold >= 1.0:
                continue
            exiting = step.reached(gates[t], self.threshold)
            if not exiting:
                continue
            if not self.kv_sharing:
                copy_forward(self.backend.key_cache, self.backend.value_cache,
                             meta.slot_mapping[step.tokens_of(exiting)], t, len(model.layers))
            kept = step.drop(exiting, t + 1)
            if kept is None:  # every row has exited
                hidden[t + 1:] = hidden[t]
                break
            h, cos, sin = h[kept], cos[kept], sin[kept]
            self.backend.prepare(step.meta)
        self.stats.decode_tokens += len(step.decode_rows)
        self.stats.decode_loops += sum(step.loops_run.get(row, loops) for row in step.decode_rows)
        return LoopStates(hidden[:, step.readout_columns], gates[:, step.readout_columns])


class _Step:
    """One early:Q step's bookkeeping: which rows still loop, where their tokens sit in the compacted
    hidden state, and each decode row's exit CDF. Columns index the watched tokens (readout tokens and
    decode tokens), whose loop states are kept."""

    def __init__(self, batch: ScheduledBatch, meta: AttentionMetadata, readout: list[int],
                 device: torch.device) -> None:
        starts = _starts(meta.query_lens_cpu)
        decode_rows = [i for i, r in enumerate(batch.requests)
                       if r.num_computed_tokens >= r.num_prompt_tokens]
        if any(meta.query_lens_cpu[i] != 1 for i in decode_rows):
            raise RuntimeError("early:Q needs one generated token per row (Scheduler.generated_one_per_step)")
        self.full_meta, self.meta, self.device = meta, meta, device
        self.decode_token = {row: starts[row] for row in decode_rows}
        self.watched = sorted(set(readout) | set(self.decode_token.values()))
        column = {token: i for i, token in enumerate(self.watched)}
        self.readout_columns = torch.tensor([column[t] for t in readout], dtype=torch.int64, device=device)
        self.decode_columns = torch.tensor([column[self.decode_token[r]] for r in decode_rows],
                                           dtype=torch.int64, device=device)
        self.decode_rows = decode_rows
        self.looping = dict.fromkeys(decode_rows)  # decode rows still looping, in order
        self.loops_run = {}  # decode row -> loops it ran, once it has exited
        self.rows = list(range(meta.num_rows))
        self.survival = torch.ones(len(decode_rows), dtype=torch.float64, device=device)
        self.cdf = torch.zeros_like(self.survival)
        self.local = torch.arange(starts[-1], device=device)  # token index -> row of the compacted h
        self._set_live(list(range(len(self.watched))))

    def _set_live(self, live: list[int]) -> None:
        dead = sorted(set(range(len(self.watched))) - set(live))
        self.live_columns = torch.tensor(live, dtype=torch.int64, device=self.device)
        self.dead_columns = torch.tensor(dead, dtype=torch.int64, device=self.device)
        watched = torch.tensor([self.watched[c] for c in live], dtype=torch.int64, device=self.device)
        self.live_rows_of_h = self.local[watched]

    def reached(self, gate_logits: torch.Tensor, threshold: float) -> list[int]:
        """Advance the exit CDF by one loop (ouro.md §4, float64, in model/exit_policy.exit_pdf's order);
        the decode rows still looping whose CDF reached the threshold. One host sync."""
        lam = torch.sigmoid(gate_logits[self.decode_columns].double())
        self.cdf = self.cdf + lam * self.survival
        self.survival = self.survival * (1.0 - lam)
        reached = (self.cdf >= threshold).tolist()
        return [row for row, hit in zip(self.decode_rows, reached) if hit and row in self.looping]

    def tokens_of(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor([self.decode_token[r] for r in rows], dtype=torch.int64, device=self.device)

    def drop(self, rows: list[int], loops_run: int) -> torch.Tensor | None:
        """Take exited rows out of the batch; the rows of h to keep, or None when no row is left."""
        for row in rows:
            del self.looping[row]
            self.loops_run[row] = loops_run
        gone = set(rows)
        self.rows = [r for r in self.rows if r not in gone]
        if not self.rows:
            return None
        self.meta, tokens = select_rows(self.full_meta, self.rows)
        kept = self.local[tokens]
        self.local = torch.full_like(self.local, -1)
        self.local[tokens] = torch.arange(len(tokens), device=self.device)
        exited = {self.decode_token[r] for r in self.loops_run}
        self._set_live([c for c, token in enumerate(self.watched) if token not in exited])
        return kept
