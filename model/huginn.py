"""Huginn-0125 (docs/huginn.md): its config, read from the HF config.json and validated once, and the network,
embed -> prelude -> r x (adapter on [state, prelude output], core blocks) -> final norm -> coda -> final
norm -> tied head, as step-wise methods a loop driver calls one recurrence at a time. HuginnForCausalLM
implements the looped-model interface (model/looped.py) with them.

Like model/ouro.py, the network never sees the KV cache: it calls `attention(q, k, v, slot)` once per
(slot, layer application), and whatever stands behind that callable owns K/V. Slots are numbered per token:
prelude layer j is slot j, core recurrence i (0-based) layer l is P + i*C + l, coda layer c is P + r*C + c,
with r the recurrences the slot map holds (HuginnConfig.core_slot, coda_slot). With fused_kernels, calls of
decode-sized rows run the blocks as Triton kernels instead (model/huginn_fused.py), the same network.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model import huginn_fused
from model.looped import Attention, ModelShape, SlotMap, StepContext
from model.ouro import RMSNorm

# The two warm starts (continuous_compute) of the official code: the previous token's final state after the
# final norm (generate_minimal's latent_states) or as the last recurrence left it (the adaptive path's).
WARM_STARTS = ("normalized", "raw")

# What config.json must say where it says anything: Huginn-0125's architecture, as the official
# RavenConfig names it. The training-only fields (sampling_scheme, mean_backprop_depth, init_strategy, ...)
# are not read.
_FIXED = {"injection_type": "linear", "state_init": "like-init", "bias": False,
          "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
          "norm_class_name": "RMSNorm_llama"}
_WHY = {"injection_type": "the adapter on [state, prelude output]",
        "state_init": "the like-init initial state", "bias": "no Linear has a bias",
        "block_class_name": "sandwich blocks", "mlp_class_name": "the gated MLP", "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm"}
_REQUIRED = ("n_embd", "n_heads", "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
             "mean_recurrence", "intermediate_size", "vocab_size", "rope_base", "norm_eps", "block_size")


@dataclasses.dataclass(frozen=True, slots=True)
class HuginnConfig:
    n_embd: int
    n_heads: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    mean_recurrence: int
    intermediate_size: int
    vocab_size: int
    padded_vocab_size: int
    rope_base: float
    norm_eps: float
    block_size: int
    qk_bias: bool
    tie_embeddings: bool
    init_std: float  # init_values["std"]: the initial state's std before the embedding scale
    embed_scale: float  # init_values["embed_scale"]: sqrt(n_embd) in Huginn-0125
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # The initial state's scale (the official forward's init_scale argument, 1.0 there): config.json may
    # say otherwise; 0 gives the zero state.
    init_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("n_embd", "n_heads", "n_layers_in_recurrent_block", "mean_recurrence",
                     "intermediate_size", "vocab_size", "padded_vocab_size", "block_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("n_layers_in_prelude", "n_layers_in_coda"):
            _check_int(name, getattr(self, name), 0)
        if self.n_embd % self.n_heads:
            raise ValueError(f"config field 'n_embd' ({self.n_embd}) must be a multiple of 'n_heads' "
                             f"({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config fields 'n_embd' / 'n_heads' give head_dim {self.head_dim}, which "
                             "must be even (RoPE rotates pairs of dims)")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"config field 'padded_vocab_size' ({self.padded_vocab_size}) must be at least "
                             f"'vocab_size' ({self.vocab_size})")
        for name in ("rope_base", "norm_eps", "init_std", "embed_scale"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                field = f"init_values.{name.removeprefix('init_')}" if name in ("init_std", "embed_scale") \
                    else name
                raise ValueError(f"config field {field!r} must be a finite positive number, got {value!r}")
        for name in ("qk_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config field {name!r} must be true or false, got {getattr(self, name)!r}")
        for i in self.eos_token_ids:
            if not _is_int(i) or not 0 <= i < self.padded_vocab_size:
                raise ValueError(f"config field 'eos_token_id' must be token ids below padded_vocab_size "
                                 f"({self.padded_vocab_size}), got {i!r}")
        bos = self.bos_token_id
        if bos is not None and (not _is_int(bos) or not 0 <= bos < self.padded_vocab_size):
            raise ValueError(f"config field 'bos_token_id' must be a token id below padded_vocab_size "
                             f"({self.padded_vocab_size}) or null, got {bos!r}")
        if self.torch_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"config field 'torch_dtype' must be float32, float16 or bfloat16, "
                             f"got {self.torch_dtype!r}")
        if not _is_number(self.init_scale) or not 0 <= self.init_scale < math.inf:
            raise ValueError(f"config field 'init_scale' must be a finite number >= 0, "
                             f"got {self.init_scale!r}")

    # -- what the engine reads of a looped config (model/looped.py: LoopedConfig) --------------------------

    @property
    def shape(self) -> ModelShape:
        """loops: mean_recurrence, the recurrences every token runs (the official num_steps default)."""
        return ModelShape(self.n_embd, self.n_heads, self.n_heads, self.head_dim, self.vocab_size,
                          self.mean_recurrence)

    @property
    def max_position_embeddings(self) -> int:
        return self.block_size  # the official RoPE table's rows

    @property
    def early_exit_threshold(self) -> None:
        return None  # no exit gate

    def with_overrides(self, loops: int | None = None, exit_threshold: float | None = None) -> HuginnConfig:
        """The recurrences (loops, the official num_steps) overridden; an exit threshold is refused: Huginn
        has no exit gate."""
        if exit_threshold is not None:
            raise ValueError(f"exit_threshold={exit_threshold!r}: Huginn-0125 has no exit gate to threshold; "
                             "it exits by a criterion on successive recurrences (docs/huginn.md)")
        if loops is None:
            return self
        if not _is_int(loops) or loops < 1:
            raise ValueError(f"loops must be an integer >= 1, got {loops!r}")
        return dataclasses.replace(self, mean_recurrence=loops)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    def num_slots(self, recurrences: int) -> int:
        """KV slots a token has when the slot map holds `recurrences` core recurrences."""
        return self.core_slot(recurrences, 0) + self.n_layers_in_coda

    def core_slot(self, recurrence: int, layer: int) -> int:
        """Core recurrence `recurrence` (0-based), core layer `layer`: P + recurrence * C + layer."""
        return self.n_layers_in_prelude + recurrence * self.n_layers_in_recurrent_block + layer

    def coda_slot(self, layer: int, recurrences: int) -> int:
        """Coda layer `layer`: after every core slot of the map, whatever recurrence a token read out at."""
        return self.core_slot(recurrences, layer)

    def physical_layer(self, slot: int, recurrences: int) -> int:
        """The checkpoint block a slot runs, counted prelude 0..P-1, core P..P+C-1, coda P+C..P+C+D-1."""
        prelude, core = self.n_layers_in_prelude, self.n_layers_in_recurrent_block
        if not 0 <= slot < self.num_slots(recurrences):
            raise ValueError(f"slot {slot} is outside 0..{self.num_slots(recurrences) - 1} "
                             f"({recurrences} recurrences)")
        if slot < prelude:
            return slot
        if slot < prelude + recurrences * core:
            return prelude + (slot - prelude) % core
        return prelude + core + slot - prelude - recurrences * core

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        return cls(**_fields_from_hf(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> HuginnConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)


def _fields_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """HF config.json keys onto HuginnConfig fields. Optional keys take the official RavenConfig class's
    defaults (qk_bias and tie_embeddings true, init_values derived from n_embd), as the remote code would."""
    model_type = raw.get("model_type")
    if model_type != "huginn_raven":
        raise ValueError(f"config field 'model_type' must be 'huginn_raven', got {model_type!r}")
    for name in _REQUIRED:
        if name not in raw:
            raise ValueError(f"config.json is missing the required field {name!r}")
    for name, value in _FIXED.items():
        if name in raw and raw[name] != value:
            raise ValueError(f"config field {name!r} must be {value!r} (Huginn-0125's {_WHY[name]}), "
                             f"got {raw[name]!r}")
    if raw.get("test_time_noise", 0) != 0:
        raise ValueError(f"config field 'test_time_noise' must be 0 (no noise at inference), "
                         f"got {raw['test_time_noise']!r}")
    hidden, heads = raw["n_embd"], raw["n_heads"]
    layers = (raw["n_layers_in_prelude"], raw["n_layers_in_recurrent_block"], raw["n_layers_in_coda"])
    if "n_layers" in raw and all(_is_int(x) for x in layers) and raw["n_layers"] != sum(layers):
        raise ValueError(f"config field 'n_layers' ({raw['n_layers']!r}) must be prelude + recurrent block + "
                         f"coda layers ({sum(layers)})")
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] != heads:
        raise ValueError(f"config field 'num_key_value_heads' must equal n_heads ({heads!r}): Huginn has no "
                         f"grouped-query attention, got {raw['num_key_value_heads']!r}")
    if "head_dim" in raw and _is_int(hidden) and _is_int(heads) and heads > 0 and \
            raw["head_dim"] != hidden // heads:
        raise ValueError(f"config field 'head_dim' must be n_embd / n_heads ({hidden // heads}), "
                         f"got {raw['head_dim']!r}")
    init_values = raw.get("init_values")
    if init_values is None and _is_number(hidden) and hidden > 0:
        init_values = {"std": math.sqrt(2 / (5 * hidden)), "embed_scale": math.sqrt(hidden)}
    if not isinstance(init_values, dict) or not {"std", "embed_scale"} <= init_values.keys():
        raise ValueError(f"config field 'init_values' must be an object with 'std' and 'embed_scale', "
                         f"got {init_values!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        n_embd=hidden, n_heads=heads, n_layers_in_prelude=layers[0], n_layers_in_recurrent_block=layers[1],
        n_layers_in_coda=layers[2], mean_recurrence=raw["mean_recurrence"],
        intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
        padded_vocab_size=raw.get("padded_vocab_size", raw["vocab_size"]), rope_base=raw["rope_base"],
        norm_eps=raw["norm_eps"], block_size=raw["block_size"], qk_bias=raw.get("qk_bias", True),
        tie_embeddings=raw.get("tie_embeddings", True), init_std=init_values["std"],
        embed_scale=init_values["embed_scale"],
        torch_dtype=raw.get("torch_dtype", raw.get("dtype", "bfloat16")),
        eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"), init_scale=raw.get("init_scale", 1.0))


def _check_int(name: str, value: Any, least: int) -> None:
    if not _is_int(value) or value < least:
        raise ValueError(f"config field {name!r} must be an integer >= {least}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def half_split_order(head_dim: int) -> torch.Tensor:
    """The row order that turns Huginn's adjacent-pair RoPE into the half-split (NeoX) one: a head's dims
    [0, 2, 4, ..., 1, 3, 5, ...]. The loader permutes every head's q and k rows (and their bias) by it, so
    pair j = (2j, 2j+1) becomes (j, j + head_dim/2); q.k is a sum over the same products, v is untouched."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


class Rotary(nn.Module):
    """Huginn's RoPE tables: pair j turns by position * base^(-2j/head_dim), built in fp32 as the official
    code does, laid out for half-split rows (half_split_order): [N, 1, head_dim] cos and sin, in fp32.
    inv_freq is an fp32 buffer: load the model in its dtype rather than casting it with Module.to(dtype),
    which would round the buffer too."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        # On the CPU even inside a meta-device context, as OuroForCausalLM's Rotary.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self.register_buffer("inv_freq", 1.0 / (base ** exponents), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x [N, heads, D] (rows in half_split_order) in fp32, cast back to x's dtype:
    per pair, x_j cos - x_{j+D/2} sin and x_{j+D/2} cos + x_j sin, the products of the official
    adjacent-pair code (tests/test_huginn_model.py checks the bits)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Fused q|k|v projection, the per-head q and k bias before RoPE, the attention callable, proj."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        hidden = config.n_embd
        self.num_heads, self.head_dim = config.n_heads, config.head_dim
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=False)  # q and k rows in half_split_order per head
        self.qk_bias = nn.Parameter(torch.zeros(2, self.num_heads, self.head_dim)) if config.qk_bias else None
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                slot: int) -> torch.Tensor:
        n = x.shape[0]
        qkv = F.linear(x, self.Wqkv.weight).view(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        if self.qk_bias is not None:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        out = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, slot)
        return F.linear(out.reshape(n, -1), self.proj.weight)


class GatedMLP(nn.Module):
    """proj(silu(gate) * up), with gate | up the two halves of one fc projection."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.fc.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.proj.weight)


class SandwichBlock(nn.Module):
    """Huginn's block: each sublayer pre-normed, and the residual stream itself re-normed after each add
    (norm_2, norm_4), which is not Ouro's sandwich (Ouro norms the sublayer output before the add)."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        hidden, eps = config.n_embd, config.norm_eps
        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = (RMSNorm(hidden, eps) for _ in range(4))
        self.attn = CausalSelfAttention(config)
        self.mlp = GatedMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                slot: int) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin, attention, slot) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnForCausalLM(nn.Module):
    """Inference only. Every method takes the flattened new tokens of a step ([N] ids, [N, n_embd] states).

    As a looped model (model/looped.py: LoopedModel): embed scales the embedding; the prelude's output is the
    injection every loop reads (StepContext.injection), and loop 0 starts from the zero state unless the
    runner gives the tokens their own (initial_state, warm_state); a loop is the adapter on [state,
    injection] and the core blocks; the coda (final norm, coda blocks, final norm) runs on the last loop's
    state; the head is tied. There is no exit gate. The step-wise methods (run_prelude, core_step,
    run_coda, logits) take the RoPE tables and the coda's slot explicitly, for tests at any depth.

    fused_kernels: calls of decode-sized rows (huginn_fused.fits) run the prelude, each recurrence and the
    coda as Triton kernels around skinny GEMMs, and the head as a skinny GEMM (model/huginn_fused.py);
    larger calls, and every call without it, run the torch ops below."""

    exit_gate = None

    def __init__(self, config: HuginnConfig, fused_kernels: bool = False) -> None:
        super().__init__()
        if fused_kernels and not huginn_fused.available():
            raise ValueError("fused_kernels=True needs the triton package, which is not installed here")
        self.config = config
        self.fused_kernels = fused_kernels  # Triton kernels around the GEMMs (no autograd: inference only)
        self.slot_map = SlotMap(config.mean_recurrence, config.n_layers_in_recurrent_block,
                                config.n_layers_in_prelude, config.n_layers_in_coda)
        hidden = config.n_embd
        # Uninitialised, as OuroForCausalLM's embedding: the loader assigns every tensor.
        self.wte = nn.Embedding(config.padded_vocab_size, hidden,
                                _weight=torch.empty(config.padded_vocab_size, hidden))
        self.prelude_blocks = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * hidden, hidden, bias=False)
        self.core_blocks = nn.ModuleList(SandwichBlock(config)
                                         for _ in range(config.n_layers_in_recurrent_block))
        self.coda_blocks = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda))
        self.ln_f = RMSNorm(hidden, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(hidden, config.padded_vocab_size,
                                                                    bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_base)
        # what the fused path keeps between calls (model/huginn_fused.py), wherever triton can run it
        blocks = len(self.prelude_blocks) + len(self.core_blocks) + len(self.coda_blocks)
        self.fused_path = huginn_fused.FusedHuginn(blocks) if huginn_fused.available() else None

    # -- the looped-model interface --------------------------------------------------------------------

    @property
    def shape(self) -> ModelShape:
        return self.config.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times embed_scale, in the model dtype, as the official code scales it."""
        return self.wte(input_ids) * self.config.embed_scale

    def step_context(self, positions: torch.Tensor, dtype: torch.dtype) -> StepContext:
        """The fp32 RoPE tables (apply_rope rotates in fp32 whatever the states' dtype)."""
        return StepContext(*self.rotary(positions))

    def prelude(self, embedded: torch.Tensor, context: StepContext,
                attention: Attention) -> tuple[torch.Tensor, StepContext]:
        """The prelude blocks (slots 0..P-1) once per token: loop 0's state (zero; the runner replaces it
        by the tokens' drawn or warm states) and the context with the prelude's output as the injection."""
        e = self._prelude_blocks(embedded, context.cos, context.sin, attention)
        return torch.zeros_like(e), StepContext(context.cos, context.sin, e)

    def loop(self, state: torch.Tensor, context: StepContext, t: int, attention: Attention) -> torch.Tensor:
        """Recurrence t on the slot map's loop_slots(t) (a ring's, under the KV layout compress:k)."""
        return self._recur(state, context.injection, context.cos, context.sin, attention,
                           self.slot_map.loop_slots(t))

    def coda(self, state: torch.Tensor, context: StepContext, attention: Attention) -> torch.Tensor:
        """The readout hidden of the last loop's state, on the slot map's coda slots."""
        return self._coda(state, context.cos, context.sin, attention, self.slot_map.coda_slots)

    def compute_logits(self, hidden: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(hidden)  # skip is a hint; the coda runs whatever it says

    def warm_state(self, final: torch.Tensor, warm_start: str) -> torch.Tensor:
        """The next token's initial state from a token's last-loop state [n, H] (continuous_compute):
        "normalized" ln_f of it (the official generate_minimal), "raw" as is (the official adaptive path)."""
        if warm_start not in WARM_STARTS:
            raise ValueError(f"continuous_compute must be one of {', '.join(WARM_STARTS)}, "
                             f"got {warm_start!r}")
        return self.ln_f(final) if warm_start == "normalized" else final

    # -- the step-wise network -------------------------------------------------------------------------

    def run_prelude(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attention: Attention) -> torch.Tensor:
        """The injection e: the embedding times embed_scale (in the model dtype), then the prelude blocks
        (slots 0..P-1). Computed once per token; every recurrence reads it."""
        return self._prelude_blocks(self.embed(input_ids), cos, sin, attention)

    def _prelude_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        attention: Attention) -> torch.Tensor:
        if huginn_fused.fits(self, x):
            return self.fused_path.prelude(self, x, cos, sin, attention)
        for j, block in enumerate(self.prelude_blocks):
            x = block(x, cos, sin, attention, j)
        return x

    def initial_state(self, e: torch.Tensor, init_scale: float = 0.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """s0 like e: i.i.d. truncated normal, std init_std * init_scale clipped at 3 std, times embed_scale
        (the official like-init), drawn in fp32 from `generator` (on e's device; None: torch's global RNG)
        and cast to e's dtype. The same distribution as the official code, not its bits: it draws in the
        model dtype from the global RNG, after a discarded normal draw. init_scale 0 gives exact zeros."""
        if not _is_number(init_scale) or not 0 <= init_scale < math.inf:
            raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
        std = self.config.init_std * init_scale
        if std == 0:
            return torch.zeros_like(e)
        state = torch.empty(e.shape, dtype=torch.float32, device=e.device)
        torch.nn.init.trunc_normal_(state, 0.0, std, -3 * std, 3 * std, generator=generator)
        return (state * self.config.embed_scale).to(e.dtype)

    def core_step(self, state: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attention: Attention, recurrence: int) -> torch.Tensor:
        """One recurrence (0-based index `recurrence`): adapter(concat(state, e)), state first, then the core
        blocks in slots core_slot(recurrence, 0..C-1). Returns the next state (raw: no final norm)."""
        slots = [self.config.core_slot(recurrence, layer) for layer in range(len(self.core_blocks))]
        return self._recur(state, e, cos, sin, attention, slots)

    def _recur(self, state: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attention: Attention, slots: Sequence[int]) -> torch.Tensor:
        if huginn_fused.fits(self, state):
            return self.fused_path.recur(self, state, e, cos, sin, attention, slots)
        x = F.linear(torch.cat([state, e], dim=-1), self.adapter.weight)
        for block, slot in zip(self.core_blocks, slots, strict=True):
            x = block(x, cos, sin, attention, slot)
        return x

    def run_coda(self, state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                 recurrences: int) -> torch.Tensor:
        """ln_f, the coda blocks (slots coda_slot(0..D-1, recurrences), after all core slots of a map that
        holds `recurrences` recurrences), then ln_f again (the same weights): the hidden logits() reads."""
        slots = [self.config.coda_slot(layer, recurrences) for layer in range(len(self.coda_blocks))]
        return self._coda(state, cos, sin, attention, slots)

    def _coda(self, state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
              slots: Sequence[int]) -> torch.Tensor:
        if huginn_fused.fits(self, state):
            return self.fused_path.coda(self, state, cos, sin, attention, slots)
        x = self.ln_f(state)
        for block, slot in zip(self.coda_blocks, slots, strict=True):
            x = block(x, cos, sin, attention, slot)
        return self.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head (tied to wte unless the config says otherwise), no scale or softcap; fp32 like the
        official code's output. With fused_kernels a skinny GEMM on CUDA at decode sizes (gemv.linear)."""
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        if self.fused_kernels:
            return self.fused_path.logits(hidden, weight)
        return F.linear(hidden, weight).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention, num_steps: int,
                init_scale: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits [N, padded_vocab_size] of every new token after num_steps recurrences (0 is legal: the coda
        reads ln_f(s0)). Positions must stay below block_size, the official RoPE table's length."""
        if not _is_int(num_steps) or num_steps < 0:
            raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
        cos, sin = self.rotary(positions)
        e = self.run_prelude(input_ids, cos, sin, attention)
        state = self.initial_state(e, init_scale, generator)
        for recurrence in range(num_steps):
            state = self.core_step(state, e, cos, sin, attention, recurrence)
        return self.logits(self.run_coda(state, cos, sin, attention, num_steps))
