"""The Ouro network (docs/ouro.md §2-§4): embed -> T x (L sandwich layers, then the final norm) -> exit gate,
lm_head, as the reference torch code; OuroForCausalLM implements the looped-model interface (model/looped.py).

The model never sees the KV cache. It calls `attention(q, k, v, slot)` once per (loop, layer), with the slots
of its slot map (slot = loop * L + layer), and whatever stands behind that callable (a paged backend, or
dense causal attention for training) owns the K/V. With fused_kernels the layers run as Triton kernels
instead (model/ouro_fused.py), the same network.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant, ouro_fused
from model.config import OuroConfig
from model.looped import Attention, LoopStates, ModelShape, SlotMap, StepContext


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in fp32, cast back to the input dtype, then scale by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.batch_invariant = False  # row by row (model/batch_invariant.py), for Engine(deterministic=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return batch_invariant.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Default (NeoX, rotate-half) RoPE over the full head_dim. Tables are built in fp32, then cast."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # On the CPU even inside a meta-device context (the loader's), where this arithmetic would import
        # torch._dynamo (seconds of start-up): a meta-built model has its real table, which the loader moves.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponents), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class OuroLayer(nn.Module):
    """One sandwich layer: each sublayer is pre-normed and post-normed before the residual add."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads,
                                                            config.num_key_value_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.gate_up_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.input_layernorm_2 = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm_2 = RMSNorm(hidden, eps)
        self.eps = eps
        self.batch_invariant = False  # the torch ops row by row (model/batch_invariant.py)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                slot: int) -> torch.Tensor:
        n = h.shape[0]
        linear, silu = (batch_invariant.linear, batch_invariant.silu) if self.batch_invariant else (F.linear,
                                                                                                    F.silu)
        q, k, v = linear(self.input_layernorm(h), self.qkv_proj.weight).split([self.q_size, self.kv_size,
                                                                               self.kv_size], -1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = attention(q, k, v, slot).reshape(n, self.q_size)
        h = h + self.input_layernorm_2(linear(attn, self.o_proj.weight))
        gate, up = linear(self.post_attention_layernorm(h), self.gate_up_proj.weight).chunk(2, dim=-1)
        return h + self.post_attention_layernorm_2(linear(silu(gate) * up, self.down_proj.weight))


class OuroForCausalLM(nn.Module):
    """Ouro as a looped model (model/looped.py: LoopedModel): no prelude and no coda (the final norm closes
    every loop, so a loop's output is its readout state), an exit gate, and the slot map t * L + l."""

    prelude = None
    coda = None
    initial_state = None
    warm_state = None

    def __init__(self, config: OuroConfig, fused_kernels: bool = False,
                 batch_invariant: bool = False) -> None:
        """batch_invariant (Engine(deterministic=True)): a row's bits never depend on the other rows of a call
        or on their number: with fused_kernels one tensor-core GEMM config per weight for every row count
        (model/kernels/gemv.py: invariant_config), else the torch ops row by row
        (model/batch_invariant.py)."""
        super().__init__()
        if fused_kernels and not ouro_fused.available():
            raise ValueError("fused_kernels=True needs the triton package, which is not installed here")
        self.config = config
        self.slot_map = SlotMap(config.total_ut_steps, config.num_hidden_layers)
        self.fused_kernels = fused_kernels  # Triton kernels around the GEMMs (no autograd: inference only)
        # With fused_kernels, decode-sized batches run each layer as 4 epilogue-fused GEMMs; False keeps the
        # unfused reference composition (tests and A/B benchmarks).
        self.fused_epilogues = True
        # what the fused path keeps between calls (model/ouro_fused.py), wherever triton can run it
        self.fused_path = ouro_fused.FusedOuro(config.num_hidden_layers) if ouro_fused.available() else None
        self.batch_invariant = batch_invariant
        hidden = config.hidden_size
        # Uninitialised: the loader assigns every tensor (an init on the meta device, a normal_, would import
        # torch._dynamo as Rotary's arithmetic would).
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden,
                                         _weight=torch.empty(config.vocab_size, hidden))
        self.layers = nn.ModuleList(OuroLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(hidden, 1, bias=True)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        for module in self.modules():
            if isinstance(module, (RMSNorm, OuroLayer)):
                module.batch_invariant = batch_invariant

    # -- the looped-model interface --------------------------------------------------------------------

    @property
    def shape(self) -> ModelShape:
        return self.config.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def exit_gate(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.gate_logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def step_context(self, positions: torch.Tensor, dtype: torch.dtype) -> StepContext:
        return StepContext(*self.rotary(positions, dtype))

    def loop(self, state: torch.Tensor, context: StepContext, t: int, attention: Attention) -> torch.Tensor:
        return self.run_loop(state, context.cos, context.sin, attention, t)

    def compute_logits(self, hidden: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        return self._linear(hidden, self.lm_head, skip)

    # -- the network -----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> LoopStates:
        """Every loop over the flattened new tokens, every token reading out: the interface's pieces composed
        in their order, for tests and training (the engine runs them through runner/loop_driver.py:
        run_loops). The final norm closes every loop and its output both feeds the next loop and is that
        loop's readout (docs/ouro.md §3)."""
        h = self.embed(input_ids)
        context = self.step_context(positions, h.dtype)
        hidden, gate_logits = [], []
        for t in range(self.slot_map.loops):
            h = self.loop(h, context, t, attention)
            hidden.append(h)
            gate_logits.append(self.gate_logits(h))
        return LoopStates(torch.stack(hidden), torch.stack(gate_logits))

    def run_loop(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                 t: int) -> torch.Tensor:
        """Loop t over the rows of h: every layer (KV slots slot_map.loop_slots(t)), then the final norm."""
        slots = self.slot_map.loop_slots(t)
        if self.fused_kernels:
            return self.fused_path.run_loop(self, h, cos, sin, attention, slots)
        for layer, slot in zip(self.layers, slots):
            h = layer(h, cos, sin, attention, slot)
        return self.norm(h)

    def _linear(self, x: torch.Tensor, module: nn.Linear, skip: torch.Tensor | None = None) -> torch.Tensor:
        """module(x), through the kernels this model runs: with fused kernels the fused path's
        (model/ouro_fused.py: FusedOuro.linear, which may leave its output unwritten where the flag `skip` is
        set), else in deterministic mode the torch ops row by row, else the module itself."""
        if self.fused_kernels:
            return self.fused_path.linear(x, module, self.batch_invariant, skip)
        if self.batch_invariant:
            return batch_invariant.linear(x, module.weight, module.bias)
        return module(x)

    def gate_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The exit gate's logit of each row of h [..., H]: [...]. With fused kernels outside deterministic
        mode, the gate's own nn.Linear (cuBLAS)."""
        if self.fused_kernels and not self.batch_invariant:
            return self.early_exit_gate(h).squeeze(-1)
        return self._linear(h, self.early_exit_gate).squeeze(-1)
