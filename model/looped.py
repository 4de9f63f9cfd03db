"""The looped-model interface: what the runner, the loop driver, the CUDA graphs, the KV pool and layouts and
the speculative path use of a model, and nothing else. A family (model/ouro.py) implements `LoopedModel`; its
`SlotMap` says where each of a token's layer applications keeps its K/V.

A step runs embed -> (prelude) -> loop 0 .. loop T-1 -> (coda) -> head: the loop driver
(runner/loop_driver.py) calls the pieces, and the model never sees the KV cache, only an `Attention` callable
it hands q, k, v and a slot. Huginn-0125 (docs/huginn.md) maps onto the same pieces: its prelude, its core
recurrence with the prelude's output injected, no exit gate, and a coda with attention.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch

# attention(q [N, heads, D], k [N, kv_heads, D], v [N, kv_heads, D], slot) -> [N, heads, D]: stores k and v in
# `slot` and attends over each token's context there.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class SlotMap:
    """A token's KV slots, in the order its layers run: the prelude's layers first (slots 0..P-1), then each
    loop's (loop t, loop layer l: slot P + t * C + l), then the coda's (P + T * C + c). A slot is one plane of
    the KV pool: a block id names the same token range in every slot. C is the layers one loop runs; the
    physical layers (the checkpoint's blocks) are numbered prelude 0..P-1, loop P..P+C-1, coda P+C..P+C+D-1.

    Ouro: SlotMap(loops=T, loop_layers=L), slot = t * L + l (docs/ouro.md §5). Huginn-0125:
    SlotMap(loops=r, loop_layers=4, prelude_layers=2, coda_layers=2) (docs/huginn.md §4).

    A ring (ring_loops=K < T, the KV layout compress:k; docs/looped_controls.md) keeps K loops' planes:
    loop t's layers use ring loop t mod K's slots, P + (t mod K) * C + l, and the coda's follow the ring
    (P + K * C + c). Each slot still runs one physical layer, since the ring is whole loops."""

    loops: int  # T: the loops the map holds slots for
    loop_layers: int  # C
    prelude_layers: int = 0  # P
    coda_layers: int = 0  # D
    ring_loops: int | None = None  # K: the loops' planes kept (None: all T, one plane per loop)

    def __post_init__(self) -> None:
        for name, least in (("loops", 1), ("loop_layers", 1), ("prelude_layers", 0), ("coda_layers", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"SlotMap {name} must be an integer >= {least}, got {value!r}")
        ring = self.ring_loops
        if ring is not None and (not isinstance(ring, int) or isinstance(ring, bool)
                                 or not 1 <= ring <= self.loops):
            raise ValueError(f"SlotMap ring_loops must be None or an integer in 1..{self.loops} (the loops), "
                             f"got {ring!r}")

    @property
    def stored_loops(self) -> int:
        """The loops whose planes the pool holds: K with a ring, else T."""
        return self.loops if self.ring_loops is None else self.ring_loops

    @property
    def num_slots(self) -> int:
        return self.prelude_layers + self.stored_loops * self.loop_layers + self.coda_layers

    @property
    def loops_only(self) -> bool:
        """True when every slot belongs to a loop (no prelude or coda slots), as Ouro's."""
        return self.prelude_layers == 0 and self.coda_layers == 0

    def slot(self, loop: int, layer: int) -> int:
        """Loop `loop`'s layer `layer` (both from 0); with a ring, ring loop loop mod K's."""
        return self.prelude_layers + loop % self.stored_loops * self.loop_layers + layer

    def loop_slots(self, loop: int) -> range:
        """The slots loop `loop` writes, one per loop layer, in the order it runs them."""
        first = self.slot(loop, 0)
        return range(first, first + self.loop_layers)

    @property
    def coda_slots(self) -> range:
        """The coda's slots, one per coda layer, in the order it runs them (after every loop plane)."""
        return range(self.num_slots - self.coda_layers, self.num_slots)

    def deeper_slots(self, loop: int, layer: int) -> range:
        """Copy-forward: a token that stopped after loop `loop` leaves slot(loop, layer)'s K/V in these slots,
        the same loop layer's in loops loop+1..T-1, where later tokens' deeper loops read it. With a ring,
        the ring loops after `loop` it never wrote (none once loop >= K-1: each ring loop holds its own)."""
        first, stride = self.prelude_layers + layer, self.loop_layers
        return range(first + (loop + 1) * stride, first + max(loop + 1, self.stored_loops) * stride, stride)

    def physical_layer(self, slot: int) -> int:
        """The checkpoint layer that slot `slot` runs."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.num_slots - 1}")
        prelude, core = self.prelude_layers, self.stored_loops * self.loop_layers
        if slot < prelude:
            return slot
        if slot < prelude + core:
            return prelude + (slot - prelude) % self.loop_layers
        return prelude + self.loop_layers + slot - prelude - core


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What the engine reads of a checkpoint's shapes, whatever its family's config calls them."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    loops: int  # T: the loops a token runs at most (the checkpoint's, or the Engine's override)


@dataclasses.dataclass(slots=True)
class StepContext:
    """What every loop of a step reads besides the loop state, per token: the RoPE tables of the tokens'
    positions and, for a family that injects its input into every loop, that input (Huginn's prelude output;
    None for Ouro)."""

    cos: torch.Tensor
    sin: torch.Tensor
    injection: torch.Tensor | None = None

    def select(self, tokens: torch.Tensor) -> StepContext:
        """The context of these tokens only (indices [n] int64), for the rows that keep looping."""
        injection = None if self.injection is None else self.injection[tokens]
        return StepContext(self.cos[tokens], self.sin[tokens], injection)


@dataclasses.dataclass(slots=True)
class LoopStates:
    """Per-loop readout states of the rows that produce logits: hidden [T, R, H] (each loop's output) and the
    exit gate's logits [T, R] (None for a model without a gate, or where the caller did not ask for them).
    For a model with a coda, readout [R, H]: the coda's output of the last loop's state, what compute_logits
    reads (None: no coda, or the run stopped before the last loop). final [W, H]: the last loop's output of
    the tokens StepInputs.keep_final names (a warm start's source), else None."""

    hidden: torch.Tensor
    gate_logits: torch.Tensor | None
    readout: torch.Tensor | None = None
    final: torch.Tensor | None = None

    def rows(self, index: slice | list[int] | torch.Tensor, final_by_row: bool = False) -> LoopStates:
        """These readout rows of the states. final_by_row: `final` holds one state a readout row (a depth
        pass's finished tokens), so it is selected too; else it is the step's and is dropped."""
        return LoopStates(self.hidden[:, index],
                          None if self.gate_logits is None else self.gate_logits[:, index],
                          None if self.readout is None else self.readout[index],
                          None if not final_by_row or self.final is None else self.final[index])


class LoopedConfig(Protocol):
    """What the engine reads of a family's config (model/config.py: OuroConfig is one)."""

    torch_dtype: str  # the checkpoint's dtype: "float32", "float16" or "bfloat16"
    max_position_embeddings: int
    early_exit_threshold: float | None  # the exit gate's Q for the `hf` readout policy (None: none)
    # The scale of the state loop 0 starts from, drawn per token (Huginn's init_scale); None: the family's
    # loop 0 starts from the embedding, with no state of its own to draw
    init_scale: float | None

    @property
    def shape(self) -> ModelShape: ...

    def with_overrides(self, loops: int | None = None,
                       exit_threshold: float | None = None) -> LoopedConfig:
        """The loop count and exit threshold overridden (None: as the checkpoint says), the rest unchanged."""


class LoopedModel(Protocol):
    """A looped network, run one piece at a time over a step's flattened new tokens ([N] ids, [N, H] states).

    The loop driver calls, in order: embed(ids) -> the first state; step_context(positions, dtype); then, once
    the attention backend holds the step's metadata, prelude (if any); loop(state, context, t, attention) for
    each loop t, each output the next loop's input and loop t's readout state (exit_gate reads it); coda (if
    any) for every token of the step after its last loop; compute_logits only for the tokens that read out.
    Loop t's layers call attention with exactly slot_map.loop_slots(t), in order; the prelude and coda with
    their own slots. A loop reads nothing but its input state, the context and its own slots' K/V, so running
    loops 0..d-1 and then d..T-1 from loop d-1's output is the full run, bit for bit."""

    slot_map: SlotMap
    # Triton kernels around the GEMMs (CUDA); the runner then reserves their workspace before any capture.
    fused_kernels: bool
    # prelude(embedded [N, H], context, attention) -> (loop 0's state, the context with the injection):
    # layers before the loops that run once per token, on slots 0..P-1. None: no prelude (Ouro).
    prelude: Callable[[torch.Tensor, StepContext, Attention], tuple[torch.Tensor, StepContext]] | None
    # coda(state, context, attention) -> the hidden compute_logits reads, run for every token of the step
    # (its layers store the coda slots' K/V that later tokens read), on the coda's slots. None: a loop's
    # output is its readout state (Ouro: the final norm closes every loop).
    coda: Callable[[torch.Tensor, StepContext, Attention], torch.Tensor] | None
    # initial_state(like [n, H], init_scale, generator) -> loop 0's state drawn like `like` (Huginn's
    # truncated normal; init_scale 0: zeros), and warm_state(final [n, H], how) -> the next token's initial
    # state from a token's last-loop state (continuous_compute: "normalized" or "raw"). None: loop 0 starts
    # from the prelude's (or the embedding's) output and there is nothing to draw or warm-start (Ouro).
    initial_state: Callable[[torch.Tensor, float, torch.Generator | None], torch.Tensor] | None
    warm_state: Callable[[torch.Tensor, str], torch.Tensor] | None

    @property
    def shape(self) -> ModelShape: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the states the loops pass on."""

    @property
    def exit_gate(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The exit gate: a loop's readout states [..., H] -> gate logits [...]. None: the family has none."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] int64 -> [N, H]: the tokens' embeddings, loop 0's state (or the prelude's input)."""

    def step_context(self, positions: torch.Tensor, dtype: torch.dtype) -> StepContext:
        """The RoPE tables of the tokens' positions [N], for states of `dtype`."""

    def loop(self, state: torch.Tensor, context: StepContext, t: int, attention: Attention) -> torch.Tensor:
        """Loop t over the tokens of `state` [n, H] (and of context): the next state [n, H]. Every loop runs
        the same weights, so loop t is loop 0 with each slot moved by slot_map.slot(t, 0) - slot(0, 0): a
        depth pass (runner/depth_passes.py) runs rows at different loops as one call of loop 0 whose attention
        moves each row to its own loop's slots."""

    def compute_logits(self, hidden: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """The head: readout states [..., H] -> logits [..., vocab]. skip: a one-element bool on the device
        that, where set, allows leaving the logits unwritten (their values are then undefined): a chained
        pass in which no row reads out spares the head's weight read. A model may ignore it."""
