"""Ouro's fused path, the one CUDA runs: model/ouro.py's network with each layer as Triton kernels around its
GEMMs (model/kernels/), taken where OuroForCausalLM.fused_kernels is set. Decode-sized batches run a layer as
epilogue-fused skinny GEMMs (model/kernels/gemv_epilogues.py); larger ones the reference composition, four
projections and four elementwise launches. Besides the kernel calls it keeps what they need between calls:
each layer's weight keys, a loop's epilogue buffers, and deterministic mode's one GEMM config per weight
shape.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from triton_runtime.installed import triton_missing
from model.config import OuroConfig
from model.looped import Attention

try:
    from model.kernels import fused, gemv_epilogues
    from model.kernels.gemv import CPU_SM_COUNT, GemvConfig, invariant_config, invariant_linear
    from model.kernels.gemv import linear as skinny_or_cublas_linear
except ModuleNotFoundError as err:  # triton missing: the torch ops only
    if not triton_missing(err):
        raise
    fused = gemv_epilogues = None

if TYPE_CHECKING:
    from model.ouro import OuroForCausalLM, OuroLayer


def available() -> bool:
    """Is triton installed, so that the fused path can run (on CUDA, or on CPU in its interpreter)?"""
    return fused is not None


# What a fused layer reads, in _forward_epilogues' order: the four projections, then the post-norm of
# attention, the MLP's pre-norm and its post-norm (input_layernorm is the launch before's next_weight).
FUSED_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm_2",
                 "post_attention_layernorm", "post_attention_layernorm_2")


class FusedOuro:
    """What the fused path keeps between calls for one model; it holds no module (each call is handed the
    model or the layer): per layer, what the kernels' plans key on of its weights (layer_weights), and in
    deterministic mode one GEMM config per weight shape and dtype (gemm_config)."""

    def __init__(self, num_layers: int) -> None:
        self.weight_keys: list[gemv_epilogues.WeightKeys | None] = [None] * num_layers
        self.gemm_configs: dict[tuple, GemvConfig] = {}

    def run_loop(self, model: OuroForCausalLM, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: Attention, slots: range) -> torch.Tensor:
        """One loop of the model, its layers on `slots`. Each layer's last launch also makes the next layer's
        pre-norm; the last layer's makes the final norm, which is the loop's output and readout."""
        layers = model.layers
        configs = self.layer_configs(layers[0]) if model.batch_invariant else None
        epilogues = None
        if model.fused_epilogues and gemv_epilogues.fits(h, layers[0].qkv_proj.weight):
            epilogues = EpilogueBuffers.for_rows(h, model.config, norm_epilogue=not model.batch_invariant)
            # the [M, D] views qkv_rope takes, made once for the loop's layers
            cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        # Through the module dicts, and without slicing the ModuleList: a slice is a new ModuleList, which
        # cost an eager step about 0.5 ms of host work on the CI CPU (4 loops of 24 layers).
        pre_norms = [layer._modules["input_layernorm"]._parameters["weight"] for layer in layers]
        normed = fused.rmsnorm(h, pre_norms[0], model.norm.eps)
        next_weights = pre_norms[1:] + [model.norm.weight]
        for index, (layer, next_weight, slot) in enumerate(zip(layers, next_weights, slots)):
            h, normed = self.layer_forward(layer, index, h, normed, cos, sin, attention, slot, next_weight,
                                           epilogues, configs)
        return normed

    def layer_forward(self, layer: OuroLayer, index: int, h: torch.Tensor, normed: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, attention: Attention, slot: int,
                      next_weight: torch.Tensor, epilogues: EpilogueBuffers | None = None,
                      configs: tuple[GemvConfig, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """OuroLayer.forward with Triton kernels (layer `index` of the model). `normed` is
        input_layernorm(h), made by the launch before; returns (h', RMSNorm(h') * next_weight), the next
        sublayer's pre-norm (or the loop's final norm).
        With `epilogues` (decode-sized batches, gemv_epilogues.fits; the buffers its layers write): each
        projection's skinny GEMM does the elementwise work after it, 4 launches; where `epilogues` has no
        buffers for the norm epilogue (past MAX_NORM_EPILOGUE_M rows, or in deterministic mode) the o and down
        projections' norms are launches of their own (6). Otherwise the reference
        composition: 4 projections (a skinny GEMM for decode-sized batches, cuBLAS otherwise) and 4
        elementwise launches. `configs` (deterministic mode): the one GEMM config of each projection (qkv, o,
        gate_up, down) for every row count (gemv.invariant_config), cuBLAS never."""
        if epilogues is not None:
            return self._forward_epilogues(layer, index, h, normed, cos, sin, attention, slot, next_weight,
                                           epilogues, configs or (None,) * 4)
        n, eps = h.shape[0], layer.input_layernorm.eps
        qkv_config, o_config, gate_up_config, down_config = configs or (None,) * 4
        qkv = _project(normed, layer.qkv_proj.weight, qkv_config)
        q, k, v = fused.rope_qkv(qkv, cos, sin, layer.num_heads, layer.num_kv_heads, layer.head_dim)
        attn = attention(q, k, v, slot).reshape(n, layer.q_size)
        h, normed = _linear_then_add_norms(attn, layer.o_proj.weight, h, layer.input_layernorm_2.weight,
                                           layer.post_attention_layernorm.weight, eps, o_config)
        act = fused.silu_mul(_project(normed, layer.gate_up_proj.weight, gate_up_config))
        return _linear_then_add_norms(act, layer.down_proj.weight, h, layer.post_attention_layernorm_2.weight,
                                      next_weight, eps, down_config)

    def _forward_epilogues(self, layer: OuroLayer, index: int, h: torch.Tensor, normed: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, attention: Attention, slot: int,
                           next_weight: torch.Tensor, buffers: EpilogueBuffers,
                           configs: tuple[GemvConfig | None, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        n, eps = h.shape[0], layer.eps
        qkv_config, o_config, gate_up_config, down_config = configs
        weights, keys = self.layer_weights(layer, index)
        qkv, o, gate_up, down, attention_norm, pre_mlp_norm, mlp_norm = weights
        q, k, v = gemv_epilogues.qkv_rope(normed, qkv, cos, sin, layer.num_heads, layer.num_kv_heads,
                                          layer.head_dim, config=qkv_config, weight_keys=keys[:1],
                                          out=buffers.qkv)
        attn = attention(q, k, v, slot).reshape(n, layer.q_size)
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

    def layer_weights(self, layer: OuroLayer, index: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The weights of FUSED_WEIGHTS of layer `index`, read through the module dicts on every call (never
        cached, so a reassigned parameter is seen): attribute access on an nn.Module (Module.__getattr__)
        costs about 1.3 µs of host time each, and an eager decode step makes 96 layer applications of 7 of
        them. With them, what the kernels' plans key on of each (gemv_epilogues.weight_key), read again only
        when a weight is another tensor or at another address (gemv_epilogues.WeightKeys says why that
        suffices)."""
        modules = layer._modules
        weights = tuple(modules[name]._parameters["weight"] for name in FUSED_WEIGHTS)
        keyed = self.weight_keys[index]
        if keyed is None or not keyed.still_hold(weights):
            keyed = self.weight_keys[index] = gemv_epilogues.WeightKeys(weights)
        return weights, keyed.keys

    def gemm_config(self, weight: torch.Tensor) -> GemvConfig:
        """Deterministic mode: the one GEMM config of this weight's shape, for every row count
        (gemv.invariant_config, made once per shape)."""
        key = (weight.shape, weight.dtype)
        config = self.gemm_configs.get(key)
        if config is None:
            device = weight.device
            sm_count = CPU_SM_COUNT
            if device.type == "cuda":
                sm_count = torch.cuda.get_device_properties(device).multi_processor_count
            config = self.gemm_configs[key] = invariant_config(*weight.shape, weight.dtype, sm_count)
        return config

    def layer_configs(self, layer: OuroLayer) -> tuple[GemvConfig, ...]:
        """gemm_config of a layer's qkv, o, gate_up and down projections (every layer has their shapes)."""
        return tuple(self.gemm_config(p.weight) for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                          layer.down_proj))

    def linear(self, x: torch.Tensor, module: nn.Linear, batch_invariant: bool,
               skip: torch.Tensor | None = None) -> torch.Tensor:
        """module(x): deterministic mode's batch-invariant GEMM (gemm_config's), else the skinny kernel for
        decode-sized batches and cuBLAS beyond. skip: a flag that may leave the skinny kernel's y unwritten
        (model/kernels/gemv.py: skinny_linear)."""
        bias = module.bias
        if batch_invariant:
            y = invariant_linear(x, module.weight, self.gemm_config(module.weight), skip=skip)
        else:
            y = skinny_or_cublas_linear(x, module.weight, skip=skip)
        return y if bias is None else y + bias


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
