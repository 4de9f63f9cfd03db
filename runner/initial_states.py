"""Each token's initial state, for a model whose loop 0 starts from a state of its own (model/looped.py:
LoopedModel.initial_state): drawn per token, or warm-started from the previous token's last loop
(continuous_compute), and the per-sequence last states that a warm start reads.

A drawn state comes from a generator of its own, seeded by (the request's state seed, the token's position)
(`token_seed`), never from a batch-wide RNG: so a token's state is the same in any batch composition, in
any prefill chunk, in a recompute after preemption, eagerly or in a CUDA graph, and on any device (the draw
is made on the CPU in fp32, then copied). The request's state seed is SamplingParams.seed, or one drawn when
the request is added (request.py: Request.state_seed).
"""

from __future__ import annotations

import torch

from model.looped import LoopedModel
from request import Request

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit over the output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def token_seed(state_seed: int, position: int) -> int:
    """The seed of the generator that draws the initial state of the token at `position` of a request whose
    state seed is `state_seed` (both < 2**64)."""
    return _mix(_mix(state_seed) ^ (position * 0x9E3779B97F4A7C15 & _MASK))


class InitialStates:
    """What loop 0 starts from, per token of a step. init_scale: the drawn states' scale (0: zeros);
    warm_start: None, or how a generated token starts from the previous token's last state ("normalized" or
    "raw", LoopedModel.warm_state). Prompt tokens are drawn (or zero) whatever warm_start says, as the
    official continuous_compute prefills."""

    def __init__(self, model: LoopedModel, init_scale: float, warm_start: str | None,
                 device: torch.device) -> None:
        self.model = model
        self.init_scale = init_scale
        self.warm_start = warm_start
        self.device = device
        self.hidden_size = model.shape.hidden_size
        # request id -> (position, the warm start of the token after it [H]): the last state a step kept
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def needed(self) -> bool:
        """False where every token starts from zeros (the prelude's state): nothing to draw or keep."""
        return self.init_scale > 0 or self.warm_start is not None

    def for_step(self, requests: list[Request], starts: list[int], ends: list[int]) -> torch.Tensor:
        """The initial states [N, H] of the step's tokens, row after row (request i's positions starts[i] to
        ends[i] - 1), in the model dtype on the device. ValueError where a warm start's source is missing."""
        drawn, warm = [], []  # (token index, its state)
        index = 0
        for request, start, end in zip(requests, starts, ends):
            for position in range(start, end):
                if self.warm_start is not None and position >= request.num_prompt_tokens:
                    warm.append((index, self._warm(request, position)))
                else:
                    drawn.append((index, self._drawn(request, position)))
                index += 1
        dtype = self.model.dtype
        hidden = torch.empty(index, self.hidden_size, dtype=dtype, device=self.device)
        for part, on_device in ((drawn, False), (warm, True)):
            if part:
                states = torch.stack([state for _, state in part])
                states = states.to(dtype) if on_device else states.to(self.device, dtype)
                hidden[[i for i, _ in part]] = states
        return hidden

    def _drawn(self, request: Request, position: int) -> torch.Tensor:
        """[H] fp32 on the CPU: the token's drawn state (zeros at init_scale 0)."""
        like = torch.empty(1, self.hidden_size)
        if self.init_scale == 0:
            return like.zero_()[0]
        if request.state_seed is None:
            raise ValueError(f"request {request.request_id} has no state seed to draw its initial states "
                             "from")
        generator = torch.Generator().manual_seed(token_seed(request.state_seed, position))
        return self.model.initial_state(like, self.init_scale, generator)[0]

    def _warm(self, request: Request, position: int) -> torch.Tensor:
        kept = self.last.get(request.request_id)
        if kept is None or kept[0] != position - 1:
            raise ValueError(f"request {request.request_id}: the warm start of position {position} needs the "
                             f"last state of position {position - 1}, which no step kept "
                             f"(kept: {None if kept is None else kept[0]})")
        return kept[1]

    def keep_rows(self, requests: list[Request], ends: list[int]) -> list[int]:
        """The rows whose last token's state the step keeps: those whose next token is a generated one."""
        if self.warm_start is None:
            return []
        return [row for row, (request, end) in enumerate(zip(requests, ends))
                if end >= request.num_prompt_tokens]

    def warm_states(self, final: torch.Tensor) -> torch.Tensor:
        """The warm starts [W, H] the kept rows' last-loop states [W, H] give."""
        return self.model.warm_state(final, self.warm_start)

    def keep(self, request_id: str, position: int, warm: torch.Tensor) -> None:
        """The step that computed `position` is applied: the token after it starts from `warm` [H]."""
        self.last[request_id] = (position, warm)

    def release(self, request_id: str) -> None:
        self.last.pop(request_id, None)
