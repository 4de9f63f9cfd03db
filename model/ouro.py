"""The Ouro network (docs/ouro.md §2-§4): embed -> T x (L sandwich layers, then the final norm) -> exit gate,
lm_head.

The model never sees the KV cache. It calls `attention(q, k, v, slot)` once per (loop, layer) with
slot = loop * L + layer, and whatever stands behind that callable (a paged backend, or dense causal
attention for training) owns the K/V.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model import batch_invariant
from model.config import OuroConfig
from triton_runtime.installed import triton_missing

try:
    from model.kernels import fused, gemv_epilogues
    from model.kernels.gemv import CPU_SM_COUNT, GemvConfig, invariant_config, invariant_linear
    from model.kernels.gemv import linear as skinny_or_cublas_linear
except ModuleNotFoundError as err:  # triton missing: the torch ops only
    if not triton_missing(err):
        raise
    fused = gemv_epilogues = None

def fused_kernels_available() -> bool:
    return fused is not None


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponents), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# What the fused layer reads, in _forward_epilogues' order: the four projections, then the post-norm of
# attention, the MLP's pre-norm and its post-norm (input_layernorm is the launch before's next_weight).
_FUSED_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm_2",
                  "post_attention_layernorm", "post_attention_layernorm_2")


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
        self._weight_keys = None  # _fused_weights' gemv_epilogues.WeightKeys, made on the first call
        self.batch_invariant = False  # the torch ops row by row (model/batch_invariant.py)

    def _fused_weights(self) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The weights of _FUSED_WEIGHTS, read through the module dicts on every call (never cached, so a
        reassigned parameter is seen): attribute access on an nn.Module (Module.__getattr__) costs about
        1.3 µs of host time each, and an eager decode step makes 96 layer applications of 7 of them. With
        them, what the kernels' plans key on of each (gemv_epilogues.weight_key), read again only when a
        weight is another tensor or at another address (gemv_epilogues.WeightKeys says why that suffices)."""
        modules = self._modules
        weights = tuple(modules[name]._parameters["weight"] for name in _FUSED_WEIGHTS)
        keyed = self._weight_keys
        if keyed is None or not keyed.still_hold(weights):
            keyed = self._weight_keys = gemv_epilogues.WeightKeys(weights)
        return weights, keyed.keys

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

    def forward_fused(self, h: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attention: Attention, slot: int, next_weight: torch.Tensor,
                      epilogues: EpilogueBuffers | None = None,
                      configs: tuple[GemvConfig, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with Triton kernels. `normed` is input_layernorm(h), made by the launch before; returns
        (h', RMSNorm(h') * next_weight), the next sublayer's pre-norm (or the loop's final norm).
        With `epilogues` (decode-sized batches, gemv_epilogues.fits; the buffers its layers write): each
        projection's skinny GEMM does the elementwise work after it, 4 launches; where `epilogues` has no
        buffers for the norm epilogue (past MAX_NORM_EPILOGUE_M rows, or in deterministic mode) the o and down
        projections' norms are launches of their own (6). Otherwise the reference
        composition: 4 projections (a skinny GEMM for decode-sized batches, cuBLAS otherwise) and 4
        elementwise launches. `configs` (deterministic mode): the one GEMM config of each projection (qkv, o,
        gate_up, down) for every row count (gemv.invariant_config), cuBLAS never."""
        if epilogues is not None:
            return self._forward_epilogues(h, normed, cos, sin, attention, slot, next_weight, epilogues,
                                           configs or (None,) * 4)
        n, eps = h.shape[0], self.input_layernorm.eps
        qkv_config, o_config, gate_up_config, down_config = configs or (None,) * 4
        qkv = _project(normed, self.qkv_proj.weight, qkv_config)
        q, k, v = fused.rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        attn = attention(q, k, v, slot).reshape(n, self.q_size)
        h, normed = _linear_then_add_norms(attn, self.o_proj.weight, h, self.input_layernorm_2.weight,
                                           self.post_attention_layernorm.weight, eps, o_config)
        act = fused.silu_mul(_project(normed, self.gate_up_proj.weight, gate_up_config))
        return _linear_then_add_norms(act, self.down_proj.weight, h, self.post_attention_layernorm_2.weight,
                                      next_weight, eps, down_config)

    def _forward_epilogues(self, h: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           attention: Attention, slot: int, next_weight: torch.Tensor,
                           buffers: EpilogueBuffers, configs: tuple[GemvConfig | None, ...]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        n, eps = h.shape[0], self.eps
        qkv_config, o_config, gate_up_config, down_config = configs
        (qkv, o, gate_up, down, attention_norm, pre_mlp_norm, mlp_norm), keys = self._fused_weights()
        q, k, v = gemv_epilogues.qkv_rope(normed, qkv, cos, sin, self.num_heads, self.num_kv_heads,
                                          self.head_dim, config=qkv_config, weight_keys=keys[:1],
                                          out=buffers.qkv)
        attn = attention(q, k, v, slot).reshape(n, self.q_size)
        # next_weight is the next layer's (or the final norm's): read here, on every call.
        down_keys = (keys[3], keys[6], gemv_epilogues.weight_key(next_weight))
        if buffers.after_attention is not None:  # the norm epilogue (EpilogueBuffers.for_rows)
            h, normed = gemv_epilogues.linear_add_norms(attn, o, h, attention_norm, pre_mlp_norm, eps,
                                                        config=o_config,
                                                        weight_keys=(keys[1], keys[4], keys[5]),
                                                        outputs=buffers.after_attention)
            act = gemv_epilogues.gate_up_silu(normed, gate_up, config=gate_up_config, weight_keys=keys[2:3],
                                              out=buffers.act)
            return gemv_epilogues.linear_add_norms(act, down, h, mlp_norm, next_weight, eps,
                                                   config=down_config, weight_keys=down_keys,
                                                   outputs=buffers.after_mlp)
        h, normed = _linear_then_add_norms(attn, o, h, attention_norm, pre_mlp_norm, eps, o_config)
        act = gemv_epilogues.gate_up_silu(normed, gate_up, config=gate_up_config, weight_keys=keys[2:3],
                                          out=buffers.act)
        return _linear_then_add_norms(act, down, h, mlp_norm, next_weight, eps, down_config)


def _project(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None) -> torch.Tensor:
    """x @ weight^T: under a deterministic-mode config the batch-invariant GEMM at any row count, else the
    skinny kernel for decode-sized batches and cuBLAS beyond."""
    if config is not None:
        return invariant_linear(x, weight, config)
    return skinny_or_cublas_linear(x, weight)


def _linear_then_add_norms(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
                           config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_epilogues.linear_add_norms as two launches: the projection, then the norm kernel, whose programs
    norm the rows side by side (faster past MAX_NORM_EPILOGUE_M rows; the reference composition's too)."""
    y = _project(x, weight, config)
    return fused.add_rmsnorm_rmsnorm(residual, y, norm_weight, next_weight, eps)


@dataclasses.dataclass(slots=True)
class EpilogueBuffers:
    """What a loop's epilogue layers write, allocated once a loop instead of six times a layer application
    (an eager decode step's host time counts every allocation). Each layer overwrites them in turn: the qkv
    output once attention has read it (and stored K and V), SiLU-mul's output once down has read it; the o
    projection's (h, normed) land in after_attention and down's in after_mlp, so each reads the other's h as
    its residual and never writes what it reads. The loop's output is the last layer's after_mlp normed,
    which the next loop's buffers (new ones) do not overwrite. The two pairs exist where the o and down
    projections end in the norm epilogue: at most MAX_NORM_EPILOGUE_M rows, outside deterministic mode (past
    them, or in it, the norm kernel runs and allocates its own); the layers take the norm epilogue where
    they are."""

    qkv: torch.Tensor
    act: torch.Tensor
    after_attention: tuple[torch.Tensor, torch.Tensor] | None
    after_mlp: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def for_rows(cls, h: torch.Tensor, config: OuroConfig, norm_epilogue: bool = True) -> EpilogueBuffers:
        """norm_epilogue False: never the norm epilogue (deterministic mode: the norm kernel, a program a row,
        gives a row its bits at every row count by construction)."""
        rows, hidden = h.shape
        pairs = (None, None)
        if norm_epilogue and rows <= gemv_epilogues.MAX_NORM_EPILOGUE_M:
            pairs = tuple((h.new_empty(rows, hidden), h.new_empty(rows, hidden)) for _ in range(2))
        return cls(h.new_empty(rows, config.q_size + 2 * config.kv_size),
                   h.new_empty(rows, config.intermediate_size), *pairs)


@dataclasses.dataclass(slots=True)
class LoopStates:
    """Per-loop readouts of the rows that produce logits: hidden [T, R, H] (post-norm), gate logits [T, R]."""

    hidden: torch.Tensor
    gate_logits: torch.Tensor


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig, fused_kernels: bool = False,
                 batch_invariant: bool = False) -> None:
        """batch_invariant (Engine(deterministic=True)): a row's bits never depend on the other rows of a call
        or on their number: with fused_kernels one tensor-core GEMM config per weight for every row count
        (model/kernels/gemv.py: invariant_config), else the torch ops row by row
        (model/batch_invariant.py)."""
        super().__init__()
        if fused_kernels and fused is None:
            raise ValueError("fused_kernels=True needs the triton package, which is not installed here")
        self.config = config
        self.fused_kernels = fused_kernels  # Triton kernels around the GEMMs (no autograd: inference only)
        # With fused_kernels, decode-sized batches run each layer as 4 epilogue-fused GEMMs; False keeps the
        # unfused reference composition (tests and A/B benchmarks).
        self.fused_epilogues = True
        self.batch_invariant = batch_invariant
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(OuroLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(hidden, 1, bias=True)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        for module in self.modules():
            if isinstance(module, (RMSNorm, OuroLayer)):
                module.batch_invariant = batch_invariant
        self._gemm_configs: dict[tuple, GemvConfig] = {}  # gemm_config's, by weight shape and dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                readout_indices: torch.Tensor | None = None) -> LoopStates:
        """Run all loops over the flattened new tokens. The final norm closes every loop and its
        output both feeds the next loop and is that loop's readout (docs/ouro.md §3)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        hidden, gate_logits = [], []
        for t in range(self.config.total_ut_steps):
            h = self.run_loop(h, cos, sin, attention, t)
            readout = h if readout_indices is None else h[readout_indices]
            hidden.append(readout)
            gate_logits.append(self.gate_logits(readout))
        return LoopStates(torch.stack(hidden), torch.stack(gate_logits))

    def run_loop(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                 t: int) -> torch.Tensor:
        """Loop t over the rows of h: every layer (KV slot t * L + layer), then the final norm."""
        if self.fused_kernels:
            return self._run_loop_fused(h, cos, sin, attention, t)
        num_layers = len(self.layers)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention, t * num_layers + index)
        return self.norm(h)

    def _run_loop_fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                        t: int) -> torch.Tensor:
        """Each layer's last launch also makes the next layer's pre-norm; the last layer's makes the final
        norm, which is the loop's output and readout."""
        layers = self.layers
        configs = self._layer_configs() if self.batch_invariant else None
        epilogues = None
        if self.fused_epilogues and gemv_epilogues.fits(h, layers[0].qkv_proj.weight):
            epilogues = EpilogueBuffers.for_rows(h, self.config, norm_epilogue=not self.batch_invariant)
            # the [M, D] views qkv_rope takes, made once for the loop's layers
            cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        # Through the module dicts, and without slicing the ModuleList: a slice is a new ModuleList, which
        # cost an eager step about 0.5 ms of host work on the CI CPU (4 loops of 24 layers).
        pre_norms = [layer._modules["input_layernorm"]._parameters["weight"] for layer in layers]
        normed = fused.rmsnorm(h, pre_norms[0], self.norm.eps)
        next_weights = pre_norms[1:] + [self.norm.weight]
        for index, (layer, next_weight) in enumerate(zip(layers, next_weights)):
            h, normed = layer.forward_fused(h, normed, cos, sin, attention,
                                            t * len(layers) + index, next_weight, epilogues, configs)
        return normed

    def gemm_config(self, weight: torch.Tensor) -> GemvConfig:
        """Deterministic mode with fused kernels: the one GEMM config of this weight's shape, for every row
        count (gemv.invariant_config, made once per shape)."""
        key = (weight.shape, weight.dtype)
        config = self._gemm_configs.get(key)
        if config is None:
            device = weight.device
            sm_count = CPU_SM_COUNT
            if device.type == "cuda":
                sm_count = torch.cuda.get_device_properties(device).multi_processor_count
            config = self._gemm_configs[key] = invariant_config(*weight.shape, weight.dtype, sm_count)
        return config

    def _layer_configs(self) -> tuple[GemvConfig, ...]:
        """gemm_config of a layer's qkv, o, gate_up and down projections (every layer has their shapes)."""
        layer = self.layers[0]
        return tuple(self.gemm_config(p.weight) for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                          layer.down_proj))

    def _linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        """module(x), through the kernels this model runs: deterministic mode's batch-invariant ones (the GEMM
        config of gemm_config, or the torch ops row by row), else the skinny kernel or cuBLAS with fused
        kernels, else the module itself."""
        bias = module.bias
        if self.fused_kernels:
            if self.batch_invariant:
                y = invariant_linear(x, module.weight, self.gemm_config(module.weight))
            else:
                y = skinny_or_cublas_linear(x, module.weight)
            return y if bias is None else y + bias
        if self.batch_invariant:
            return batch_invariant.linear(x, module.weight, bias)
        return module(x)

    def gate_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The exit gate's logit of each row of h [..., H]: [...]. With fused kernels outside deterministic
        mode, the gate's own nn.Linear (cuBLAS)."""
        if self.fused_kernels and not self.batch_invariant:
            return self.early_exit_gate(h).squeeze(-1)
        return self._linear(h, self.early_exit_gate).squeeze(-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.lm_head)
