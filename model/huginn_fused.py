"""Huginn's fused path, the one CUDA runs: model/huginn.py's prelude, recurrence and coda with each sandwich
block as Triton kernels around its GEMMs (model/kernels/), taken where HuginnForCausalLM.fused_kernels is set
and a call has decode-sized rows (at most gemv_epilogues.MAX_EPILOGUE_M); larger calls run the blocks' torch
ops (cuBLAS). Besides the kernel calls it keeps each block's weight keys between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from model.looped import Attention
from model.ouro_fused import available  # noqa: F401 - one answer for both families: is triton installed?
from triton_runtime.installed import triton_missing

try:
    from model.kernels import fused, gemv_epilogues
    from model.kernels.gemv import linear as skinny_or_cublas_linear
    from model.ouro_fused import EpilogueBuffers
except ModuleNotFoundError as err:  # triton missing: the torch ops only
    if not triton_missing(err):
        raise
    fused = gemv_epilogues = None

if TYPE_CHECKING:
    from model.huginn import HuginnForCausalLM, SandwichBlock


# What a fused block reads, as (module path, parameter) in block_forward's order: the four projections, the
# attention's post-norm, the MLP's pre-norm and its post-norm (norm_1 is the launch before's next_weight),
# then the q and k bias where the config has one.
BLOCK_WEIGHTS = ((("attn", "Wqkv"), "weight"), (("attn", "proj"), "weight"), (("mlp", "fc"), "weight"),
                 (("mlp", "proj"), "weight"), (("norm_2",), "weight"), (("norm_3",), "weight"),
                 (("norm_4",), "weight"), (("attn",), "qk_bias"))


def fits(model: HuginnForCausalLM, x: torch.Tensor) -> bool:
    """Whether a call over the rows of x takes the fused path: the model's fused_kernels, and rows the
    epilogue GEMMs take (gemv_epilogues.fits: a decode-sized batch, on CUDA or in the interpreter)."""
    return model.fused_kernels and gemv_epilogues.fits(x, model.adapter.weight)


class FusedHuginn:
    """What the fused path keeps between calls for one model; it holds no module (each call is handed the
    model): per block (prelude, core, then coda, counted from 0), what the kernels' plans key on of its
    weights (block_weights)."""

    def __init__(self, num_blocks: int) -> None:
        self.weight_keys: list[gemv_epilogues.WeightKeys | None] = [None] * num_blocks

    def prelude(self, model: HuginnForCausalLM, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        """The injection e: the prelude blocks (slots 0..P-1) over the scaled embedding."""
        blocks = model.prelude_blocks
        if not blocks:
            return embedded
        normed = fused.rmsnorm(embedded, _norm_1(blocks[0]), model.config.norm_eps)
        return self.run_blocks(blocks, 0, embedded, normed, cos, sin, attention, range(len(blocks)), None)[0]

    def recur(self, model: HuginnForCausalLM, state: torch.Tensor, e: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, attention: Attention, slots: Sequence[int]) -> torch.Tensor:
        """One recurrence: the adapter over [state, e] (a skinny GEMM on CUDA), its output's first pre-norm,
        then the core blocks on `slots`. The concatenation is one small copy a recurrence, 2 H elements a
        row, against the adapter's 2 H^2 weight elements it reads."""
        x = skinny_or_cublas_linear(torch.cat([state, e], dim=-1), model.adapter.weight)
        blocks = model.core_blocks
        normed = fused.rmsnorm(x, _norm_1(blocks[0]), model.config.norm_eps)
        return self.run_blocks(blocks, len(model.prelude_blocks), x, normed, cos, sin, attention, slots,
                               None)[0]

    def coda(self, model: HuginnForCausalLM, state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attention: Attention, slots: Sequence[int]) -> torch.Tensor:
        """ln_f, the coda blocks on `slots`, ln_f: the hidden the head reads. The first launch makes
        ln_f(state) and the first block's pre-norm of it; the last block's MLP projection ends in the final
        ln_f."""
        blocks, ln_f, eps = model.coda_blocks, model.ln_f.weight, model.config.norm_eps
        if not blocks:
            return fused.rmsnorm_rmsnorm(state, ln_f, ln_f, eps)[1]
        x, normed = fused.rmsnorm_rmsnorm(state, ln_f, _norm_1(blocks[0]), eps)
        first = len(model.prelude_blocks) + len(model.core_blocks)
        return self.run_blocks(blocks, first, x, normed, cos, sin, attention, slots, ln_f)[1]

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The head, hidden @ weight^T in fp32: a skinny GEMM for decode-sized rows on CUDA, cuBLAS beyond."""
        return skinny_or_cublas_linear(hidden, weight).float()

    def run_blocks(self, blocks: Sequence[SandwichBlock], first: int, x: torch.Tensor, normed: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, attention: Attention, slots: Sequence[int],
                   last_next_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`blocks` (block numbers first, first + 1, ..) over x on `slots`, normed = blocks[0].norm_1(x) made
        by the launch before. Returns the last block's output and RMSNorm of it times last_next_weight (None:
        the output alone, which feeds no norm)."""
        # the [M, D] views qkv_rope takes, made once for the stack's blocks
        cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        buffers = _buffers(x, blocks[0])
        next_weights = [_norm_1(block) for block in blocks[1:]] + [last_next_weight]
        for offset, (block, next_weight, slot) in enumerate(zip(blocks, next_weights, slots, strict=True)):
            x, normed = self.block_forward(block, first + offset, x, normed, cos, sin, attention, slot,
                                           next_weight, buffers)
        return x, normed

    def block_forward(self, block: SandwichBlock, index: int, x: torch.Tensor, normed: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, attention: Attention, slot: int,
                      next_weight: torch.Tensor | None,
                      buffers: EpilogueBuffers) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SandwichBlock.forward (block number `index`) as 4 epilogue GEMMs: Wqkv with the q/k bias and
        RoPE; attn.proj with norm_2 of the residual sum and norm_3 of that; fc with SiLU * up; mlp.proj with
        norm_4 of the residual sum and next_weight's norm of that. Past MAX_NORM_EPILOGUE_M rows the two
        projections' norms are launches of their own (6). `normed` is norm_1(x), made by the launch before;
        returns (x', RMSNorm(x') * next_weight, or None without a next_weight). cos, sin: [M, D]."""
        n, eps, attn = x.shape[0], block.norm_2.eps, block.attn
        weights, keys = self.block_weights(block, index)
        qkv, proj, fc, mlp_proj, norm_2, norm_3, norm_4 = weights[:7]
        bias = weights[7] if len(weights) > 7 else None
        heads, head_dim = attn.num_heads, attn.head_dim
        q, k, v = gemv_epilogues.qkv_rope(normed, qkv, cos, sin, heads, heads, head_dim,
                                          weight_keys=keys[:1] + keys[7:], out=buffers.qkv, bias=bias,
                                          rope_fp32=True)
        out = attention(q, k, v, slot).reshape(n, -1)
        x, normed = _linear_add_norms(out, proj, x, norm_2, norm_3, eps, (keys[1], keys[4], keys[5]),
                                      buffers.after_attention)
        act = gemv_epilogues.gate_up_silu(normed, fc, weight_keys=keys[2:3], out=buffers.act)
        # next_weight is the next block's (or ln_f): read here, on every call.
        down_keys = (keys[3], keys[6])
        if next_weight is not None:
            down_keys += (gemv_epilogues.weight_key(next_weight),)
        return _linear_add_norms(act, mlp_proj, x, norm_4, next_weight, eps, down_keys, buffers.after_mlp)

    def block_weights(self, block: SandwichBlock, index: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The weights of BLOCK_WEIGHTS of block `index` (the bias where there is one), read through the
        module dicts on every call, and what the kernels' plans key on of each, read again only when a weight
        was replaced (model/ouro_fused.py: FusedOuro.layer_weights says why both)."""
        weights = []
        for path, name in BLOCK_WEIGHTS:
            module = block
            for step in path:
                module = module._modules[step]
            weight = module._parameters[name]
            if weight is not None:
                weights.append(weight)
        weights = tuple(weights)
        keyed = self.weight_keys[index]
        if keyed is None or not keyed.still_hold(weights):
            keyed = self.weight_keys[index] = gemv_epilogues.WeightKeys(weights)
        return weights, keyed.keys


def _norm_1(block: SandwichBlock) -> torch.Tensor:
    return block._modules["norm_1"]._parameters["weight"]


def _buffers(x: torch.Tensor, block: SandwichBlock) -> EpilogueBuffers:
    """What a block stack's epilogue launches write over the rows of x, allocated once a stack (as
    model/ouro_fused.py's loops do; EpilogueBuffers says how the blocks take turns in them): the qkv output,
    SiLU * up's, and at most MAX_NORM_EPILOGUE_M rows, where the two norm epilogues run, their (h, normed)
    pairs."""
    rows = x.shape[0]
    qkv_width = block.attn._modules["Wqkv"]._parameters["weight"].shape[0]
    act_width = block.mlp._modules["fc"]._parameters["weight"].shape[0] // 2
    pairs = (None, None)
    if rows <= gemv_epilogues.MAX_NORM_EPILOGUE_M:
        pairs = tuple((x.new_empty(x.shape), x.new_empty(x.shape)) for _ in range(2))
    return EpilogueBuffers(x.new_empty(rows, qkv_width), x.new_empty(rows, act_width), *pairs)


def _linear_add_norms(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                      norm_weight: torch.Tensor, next_weight: torch.Tensor | None, eps: float, keys: tuple,
                      outputs: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(residual + x @ weight^T) * norm_weight =: h, RMSNorm(h) * next_weight or None): the norm
    epilogue where the caller has its outputs (at most MAX_NORM_EPILOGUE_M rows), else the projection then the
    norm kernel, whose programs norm the rows side by side."""
    if outputs is not None:
        return gemv_epilogues.linear_add_norms(x, weight, residual, norm_weight, next_weight, eps,
                                               weight_keys=keys, outputs=outputs,
                                               norm_after_add=True)
    y = skinny_or_cublas_linear(x, weight)
    if next_weight is None:
        return fused.add_rmsnorm(residual, y, norm_weight, eps, norm_after_add=True), None
    return fused.add_rmsnorm_rmsnorm(residual, y, norm_weight, next_weight, eps, norm_after_add=True)
