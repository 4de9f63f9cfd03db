"""EngineConfig: every Engine option, resolved and validated once, at construction, then frozen. The
components are built from it and read it; none sets attributes on another.

Options are checked in two rounds, both before any weight is read: the plain ones (types, ranges, names)
before the model directory is resolved, so a typo never waits for a download; those that depend on the
checkpoint (max_model_len, step:K, dtype "auto") once its config.json is read.

It imports the model families' registry, the looped config view and the locator (model/), the attention
backend registry, the KV formats (cache/kv_formats.py), the exit policies (exit_policy.py) and the shared
request types (request.py) only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from attention.registry import check_name as check_backend_name
from attention.registry import resolve_name as resolve_backend_name
from cache.kv_format import KVFormat
from cache.kv_formats import parse_kv_cache_dtype
from cache.layout import SHARED_LAST, parse_kv_layout
from exit_policy import ExitPolicy, parse_exit_policy
from model.loader import resolve_model_dir
from model.looped import LoopedConfig
from model.registry import check_engine_options, read_config
from request import ADMISSION

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_SHARING = ("none", "last")
CONTINUOUS_COMPUTE = ("normalized", "raw")  # the warm starts (EngineConfig.continuous_compute)
CHAIN_PASSES_PER_LOOP = 4  # depth batching's default passes a step, per loop (EngineConfig.step_passes)
# deterministic=None, per device type: on where its measured cost is small (docs/deterministic.md).
DETERMINISTIC_BY_DEFAULT = {"cpu": False, "cuda": False}


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: Path
    model: LoopedConfig  # the checkpoint's config (its family's class), with the loop-count override applied
    device: torch.device
    dtype: torch.dtype
    attention: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory at start-up
    kv_cache_gib: float | None = None  # the KV pool's size in GiB instead of the memory rule
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048  # at most the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    packed_prefill: bool = False
    enforce_eager: bool = False
    # Steps with prompt tokens, of at most this many tokens, replay piecewise CUDA graphs
    # (runner/piecewise_graphs.py); larger ones, or all of them at 0, run eagerly.
    piecewise_graph_tokens: int = 512
    exit_policy: ExitPolicy = ExitPolicy("full")
    kv_sharing: str = "none"
    # Where K/V lives across loops (cache/layout.py): "full", "latest", "compress:k" or "latest-compress:k";
    # None: "latest" under an exit policy that stops loops, else "full" (layout_name resolves it)
    kv_layout: str | None = None
    # Self-speculative decoding (docs/speculative.md): "loops:d" drafts with the first d loops; None: off.
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # k, the drafts per step (default 4 when speculative is on)
    # "reserve": admit a request only if the pool also covers what the running ones are expected to claim
    # (scheduler/scheduler.py); "greedy": whenever its next chunk fits, preempting later if need be.
    admission: str = "reserve"
    # How K/V is stored (cache/kv_formats.py): "auto" (the model dtype), "bf16", "fp8_e4m3" or a KVarN preset.
    kv_cache_dtype: str = "auto"
    # KVarN: positions kept in high precision, the first kv_sink_tokens and the kv_tail_tokens newest
    kv_sink_tokens: int = 0
    kv_tail_tokens: int = 0
    # KVarN: the Hadamard rotation over head_dim before normalizing (KVarN's step 1); False: none (the torch
    # backend only), for ablations
    kv_rotation: bool = True
    # Async scheduling (engine.py): the host schedules and prepares the next step while the device runs
    # this one. None: on for CUDA where it applies (not with speculative decoding or early:Q; with pipelined
    # speculation, for its steps whose drafts pause); True or False: as asked.
    async_scheduling: bool | None = None
    # Batch invariance (docs/deterministic.md): a request's logits have the same bits whatever else runs
    # beside it, in eager steps and in CUDA graphs. None: the default (DETERMINISTIC_BY_DEFAULT); True or
    # False: as asked.
    deterministic: bool | None = None
    # Refuse a checkpoint whose weights hold a NaN or an infinity, naming the tensor (model/loader.py); False
    # skips the check (about 7% of a CPU load, a small part of a GPU one)
    check_finite_weights: bool = True
    # A model whose loop 0 starts from a state of its own (Huginn): the scale of the drawn initial states
    # (the official init_scale; 0: the zero state, deterministic). None: the checkpoint's (config.json's
    # init_scale, else 1.0 as the official code).
    init_scale: float | None = None
    # Such a model's warm start (the official continuous_compute): a generated token starts from the previous
    # token's last state, "normalized" (after the final norm, the official generate_minimal) or "raw" (as the
    # last loop left it, the official adaptive path). None: every token from its drawn (or zero) state.
    continuous_compute: str | None = None
    # Continuous depth batching (runner/depth_passes.py): a decode step is one loop pass in which every decode
    # row runs its own next loop, so rows at different loops share one weight read; False: every step runs
    # its decode rows through all their loops together (lockstep).
    depth_batching: bool = False
    # Depth batching: the loop passes a decode step chains on the device, read by the host once a step
    # (runner/pass_chains.py); None: four times the loops where chains apply (step_passes), else 1.
    passes_per_step: int | None = None

    def __post_init__(self) -> None:
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name not in ("model_dir", "model", "device", "dtype")}
        check_options(**options)
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings {self.model.max_position_embeddings}")
        # step:K is range-checked against this engine's loop count.
        parse_exit_policy(self.exit_policy, self.loops)
        self.kv_format.check_engine(options, self.backend_name, self.model.shape.head_dim)
        if self.async_scheduling:
            # pipelined speculation (depth_batching) overlaps only its steps whose drafts pause
            for bad, name in ((self.speculative is not None and not self.depth_batching,
                               f"speculative={self.speculative!r}"),
                              (self.exit_policy.can_exit, f"exit_policy={str(self.exit_policy)!r}")):
                if bad:
                    raise ValueError(f"async_scheduling=True cannot be combined with {name}: its steps read "
                                     "their tokens (or their exits) on the host before the next can start; "
                                     "leave async_scheduling at None (auto) or False")
        refusal = self.deterministic_refusal() if self.deterministic else None
        if refusal:
            raise ValueError(f"deterministic=True {refusal}")
        self._check_initial_state_options()
        self._check_depth_batching()
        check_engine_options(self.model, options)
        self._check_kv_layout()
        if self.speculative is not None:
            draft_loops(self.speculative, self.loops)  # d against this engine's loop count
            if self.exit_policy.can_exit:
                raise ValueError(f"speculative={self.speculative!r} cannot be combined with exit_policy="
                                 f"{str(self.exit_policy)!r} yet: a draft runs a fixed number of loops, "
                                 f"{self.exit_policy.kind} stops each token where it decides; use a readout "
                                 "policy")

    def _check_initial_state_options(self) -> None:
        """init_scale and continuous_compute only for a model with an initial state; a warm start reads the
        previous token's state on the host's side of a step, so never with async scheduling."""
        if self.model.init_scale is None:
            for name in ("init_scale", "continuous_compute"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r}: this checkpoint's model starts each "
                                     "token's loops from its embedding; it has no initial state to set")
        if self.continuous_compute is not None and self.speculative is not None:
            raise ValueError(f"speculative={self.speculative!r} cannot be combined with continuous_compute="
                             f"{self.continuous_compute!r}: each token starts from the previous token's last "
                             "loop, which a draft does not have until the verify has run it")
        if self.continuous_compute is not None and self.async_scheduling:
            raise ValueError(f"async_scheduling=True cannot be combined with continuous_compute="
                             f"{self.continuous_compute!r}: each token starts from the state the step "
                             "before computed, so the next step waits for it; leave async_scheduling at None "
                             "or False")

    def _check_depth_batching(self) -> None:
        """depth_batching=True against the options it does not run with yet, each refused by name."""
        if not self.depth_batching:
            if (self.passes_per_step or 1) > 1:
                raise ValueError(f"passes_per_step={self.passes_per_step} chains depth-batched loop passes; "
                                 "it needs depth_batching=True")
            return
        speculative = f"speculative={self.speculative!r} and"
        refused = [
            (self.speculative is not None and self.model.init_scale is not None,
             f"{speculative} a checkpoint with a prelude, a coda and drawn initial states (Huginn): "
             "pipelined drafts read out through loop d-1's state alone"),
            (self.speculative is not None and self.kv_layout not in (None, "full"),
             f"{speculative} kv_layout={self.kv_layout!r}: a rejected draft's slots are rewritten in place, "
             "which only the full layout is checked for"),
            (self.kv_format.kind == "kvarn",
             f"kv_cache_dtype={self.kv_cache_dtype!r}: the KVarN kernels read one slot per call, not one per "
             "row"),
            (bool(self.async_scheduling) and self.speculative is None,
             "async_scheduling=True: a row mid-token has no token for the next step to read ahead"),
        ]
        if (self.passes_per_step or 1) > 1:
            refused += [
                (self.model.init_scale is not None,
                 f"passes_per_step={self.passes_per_step} and a checkpoint with a prelude and a coda "
                 "(Huginn): a chain starts a token with its embedding alone"),
                (self.kv_sharing != "none",
                 f"passes_per_step={self.passes_per_step} and kv_sharing={self.kv_sharing!r}: a chain lists "
                 "its rows' slots in the block tables"),
            ]
        for bad, reason in refused:
            if bad:
                raise ValueError(f"depth_batching=True cannot be combined with {reason} (yet); leave "
                                 "depth_batching=False for it")

    @property
    def initial_state_scale(self) -> float | None:
        """The drawn initial states' scale (init_scale resolved; None: the model has no initial state)."""
        return self.init_scale if self.init_scale is not None else self.model.init_scale

    @property
    def draws_initial_states(self) -> bool:
        """Does each token start from a random state, drawn from its request's state seed?"""
        return bool(self.initial_state_scale)

    def _check_kv_layout(self) -> None:
        """kv_layout against the exit policy: a policy that stops loops leaves deeper slots unwritten, which
        only a latest layout fills (full and compress:k would read what an earlier token left there)."""
        if self.kv_layout is None or not self.exit_policy.can_exit:
            return
        layout = parse_kv_layout(self.kv_layout)
        if not layout.latest:
            latest = "latest" if layout.compress is None else f"latest-compress:{layout.compress}"
            raise ValueError(f"kv_layout={self.kv_layout!r} cannot be combined with exit_policy="
                             f"{str(self.exit_policy)!r}: a token that stops early leaves its deeper slots "
                             f"unwritten; kv_layout={latest!r} fills them with its last computed loop's K/V")

    @property
    def layout_name(self) -> str:
        """The KV layout (cache/layout.py: make_layout): shared-last under kv_sharing="last", else kv_layout,
        whose default is latest under an exit policy that stops loops (identical to full where every token
        runs every loop) and full otherwise."""
        if self.kv_sharing == "last":
            return SHARED_LAST
        if self.kv_layout is not None:
            return self.kv_layout
        return "latest" if self.exit_policy.can_exit else "full"

    def deterministic_refusal(self) -> str | None:
        """Why deterministic mode cannot run with these options (None: it can): it runs the Triton kernels on
        CUDA (cuBLAS picks its kernels by the batch's shape) and the torch backend's tiles on CPU, over the
        paged and shared-last layouts in the model dtype, fp8 or (torch backend) KVarN (the format says:
        KVFormat.deterministic_refusal)."""
        backend = self.backend_name
        refused = [
            (compresses(self.kv_layout),
             f"cannot be combined with kv_layout={self.kv_layout!r}: over a ring a token reads the tokens of "
             "earlier steps at their last ring write, so where a prompt is split into chunks changes its "
             "tokens"),
            (self.packed_prefill, "cannot be combined with packed_prefill=True (its packed tiles give a "
                                  "prompt's queries other sums than the paged kernel's)"),
            (self.device.type == "cuda" and backend != "triton",
             f"runs on CUDA with attention='triton' (the engine's own kernels; the torch backend's products "
             f"go through cuBLAS, which picks kernels by the batch's shape), got "
             f"attention={self.attention!r}"),
        ]
        refusal = next((reason for bad, reason in refused if bad), None)
        return refusal if refusal is not None else self.kv_format.deterministic_refusal(backend)

    @property
    def kv_format(self) -> KVFormat:
        """The format of kv_cache_dtype (cache/kv_formats.py): it builds the KV pool and binds the backend."""
        return parse_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def backend_name(self) -> str:
        """The attention backend's name, "auto" resolved (attention/registry.py: resolve_name)."""
        return resolve_backend_name(self.attention, self.device)

    @property
    def batch_invariant(self) -> bool:
        """Does the engine run in deterministic mode? (deterministic resolved: None takes the device's default
        where the other options allow it.)"""
        if self.deterministic is not None:
            return self.deterministic
        return DETERMINISTIC_BY_DEFAULT[self.device.type] and self.deterministic_refusal() is None

    @property
    def draft_loops(self) -> int | None:
        """d of speculative="loops:d" (None: no speculation)."""
        return None if self.speculative is None else draft_loops(self.speculative, self.loops)

    @property
    def speculative_tokens(self) -> int:
        """k: the most tokens one speculative step drafts per row (0: no speculation)."""
        if self.speculative is None:
            return 0
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens

    @property
    def step_passes(self) -> int:
        """The loop passes a decode step chains (passes_per_step resolved): by default four times the loops
        under depth batching where chains apply (not with a prelude or kv_sharing), so the device's wait for
        the host between steps (~1.1 ms on an H100) is paid once per four tokens a row at full depth, eight at
        two loops a token (vLLM's multi-step scheduling ran 8 steps a call); else 1."""
        if self.passes_per_step is not None:
            return self.passes_per_step
        chains = self.depth_batching and self.model.init_scale is None and self.kv_sharing == "none"
        return CHAIN_PASSES_PER_LOOP * self.loops if chains else 1

    @property
    def chain_positions(self) -> int:
        """The positions a decode row reserves for a step of chained passes (1: no chains): a token a pass
        at most; under pipelined speculation the tokens of P passes at d loops each, and the drafts then in
        flight."""
        passes = self.step_passes
        if passes == 1:
            return 1
        if self.pipelines_speculation:
            d = self.draft_loops
            return -(-passes // d) + -(-self.loops // d)
        return passes

    @property
    def pipelines_speculation(self) -> bool:
        """Does self-speculation run pipelined in depth-batched passes (runner/pipelined_speculation.py)?"""
        return self.depth_batching and self.speculative is not None

    @property
    def overlaps_steps(self) -> bool:
        """Does the engine schedule the next step while this one runs? (async_scheduling resolved.) Under
        pipelined speculation only the steps whose drafts pause run ahead (stepping.py: OverlappedStepper)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        plain = self.speculative is None and not self.depth_batching
        return (self.device.type == "cuda" and (plain or self.pipelines_speculation)
                and not self.exit_policy.can_exit and self.continuous_compute is None)

    @property
    def loops(self) -> int:
        return self.model.shape.loops

    @property
    def generated_kv_exact(self) -> bool:
        """Does every generated token keep the K/V the model computes for it at every loop, the K/V a prompt
        token would have? Not under early:Q or an exit criterion, whose exited tokens leave copies in their
        deeper slots, nor under a warm start, which starts a generated token from the previous one's state
        (so a recompute replays generated tokens one per step, each after the state it starts from)."""
        return not self.exit_policy.can_exit and self.continuous_compute is None

    @classmethod
    def resolve(cls, model: str | os.PathLike, device: str | torch.device | None = None,
                dtype: str | torch.dtype = "auto", loops: int | None = None,
                exit_threshold: float | None = None, exit_policy: str | None = None,
                **options: Any) -> EngineConfig:
        """The config of an Engine. The plain options are checked first; then `model` (a directory or a
        Hugging Face id) is resolved, its config.json read with the loop override, the device and dtype
        resolved ("auto") and the exit policy parsed. `options` are the remaining fields."""
        check_options(loops=loops, exit_threshold=exit_threshold, dtype=dtype,
                      exit_policy=exit_policy, **options)
        if exit_policy is not None and exit_threshold is not None:
            raise ValueError("pass exit_policy or exit_threshold (= exit_policy='threshold:Q'), not both")
        device = resolve_device(device)
        model_dir = resolve_model_dir(model)
        config = read_config(model_dir).with_overrides(loops, exit_threshold)
        if exit_policy is None:
            exit_policy = "full" if exit_threshold is None else f"threshold:{exit_threshold}"
        policy = parse_exit_policy(exit_policy, config.shape.loops)
        if options.get("max_model_len") is None:  # as vLLM: the checkpoint's own limit
            options["max_model_len"] = config.max_position_embeddings
        return cls(model_dir, config, device, resolve_dtype(dtype, config, device), exit_policy=policy,
                   **options)


def check_options(**values: Any) -> None:
    """Types, ranges and names of the options that need no checkpoint; ValueError naming the option.
    Options absent from `values` are not checked."""
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if name in values:
            _check_positive(name, values[name])
    tokens = values.get("piecewise_graph_tokens", 0)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"piecewise_graph_tokens must be a non-negative integer (0: no piecewise graphs), "
                         f"got {tokens!r}")
    for name in ("num_kv_blocks", "max_model_len", "loops", "passes_per_step"):
        if values.get(name) is not None:
            _check_positive(name, values[name])
    gib = values.get("kv_cache_gib")
    if gib is not None:
        if not _is_number(gib) or not 0 < gib < math.inf:
            raise ValueError(f"kv_cache_gib must be a positive number of GiB, got {gib!r}")
        if values.get("num_kv_blocks") is not None:
            raise ValueError("pass num_kv_blocks or kv_cache_gib, not both")
    for name in ("enable_prefix_caching", "packed_prefill", "enforce_eager", "check_finite_weights",
                 "depth_batching"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"{name} must be True or False, got {values[name]!r}")
    for name in ("async_scheduling", "deterministic"):
        if values.get(name) is not None and not isinstance(values[name], bool):
            raise ValueError(f"{name} must be True, False or None (the default), got {values[name]!r}")
    init_scale = values.get("init_scale")
    if init_scale is not None and (not _is_number(init_scale) or not 0 <= init_scale < math.inf):
        raise ValueError(f"init_scale must be a finite number >= 0 (0: the zero state), got {init_scale!r}")
    warm = values.get("continuous_compute")
    if warm is not None and warm not in CONTINUOUS_COMPUTE:
        raise ValueError(f"continuous_compute must be None, {' or '.join(map(repr, CONTINUOUS_COMPUTE))}, "
                         f"got {warm!r}")
    if "gpu_memory_utilization" in values:
        utilization = values["gpu_memory_utilization"]
        if not _is_number(utilization) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if "admission" in values and values["admission"] not in ADMISSION:
        raise ValueError(f"admission must be one of {', '.join(ADMISSION)}; got {values['admission']!r}")
    if "kv_sharing" in values and values["kv_sharing"] not in KV_SHARING:
        raise ValueError(f"kv_sharing must be 'none' or 'last', got {values['kv_sharing']!r}")
    if values.get("kv_layout") is not None:
        _check_kv_layout(values)
    if "kv_cache_dtype" in values:
        _check_kv_cache_dtype(values)
    threshold = values.get("exit_threshold")
    if threshold is not None and (not _is_number(threshold) or not 0 <= threshold < math.inf):
        raise ValueError(f"exit_threshold must be a finite number >= 0, got {threshold!r}")
    if values.get("exit_policy") is not None:
        parse_exit_policy(values["exit_policy"])  # its syntax; step:K's range once the loops are known
    if "dtype" in values:
        _check_dtype(values["dtype"])
    _check_speculative(values)
    if "attention" in values:
        attention = values["attention"]
        if not isinstance(attention, str):
            raise ValueError(f"attention must be a backend name, got {attention!r}")
        check_backend_name(attention)


def compresses(kv_layout: str | None) -> bool:
    """Is kv_layout a ring (compress:k or latest-compress:k)?"""
    return kv_layout is not None and parse_kv_layout(kv_layout).compress is not None


def _check_kv_layout(values: dict[str, Any]) -> None:
    """The name, and the options a layout cannot take; k against the model's loops and layers is checked
    once the model's slot map is known (cache/layout.py: make_layout)."""
    kv_layout = values["kv_layout"]
    parse_kv_layout(kv_layout)
    if values.get("kv_sharing", "none") != "none":
        raise ValueError(f"pass kv_layout or kv_sharing, not both: kv_sharing={values['kv_sharing']!r} is a "
                         f"KV layout of its own (shared-last), and kv_layout={kv_layout!r} another")
    speculative = values.get("speculative")
    if compresses(kv_layout) and speculative is not None:
        raise ValueError(f"speculative={speculative!r} cannot be combined with kv_layout={kv_layout!r}: "
                         "over a ring a draft's first loops and its verified loops would read the earlier "
                         "tokens at other ring writes than a plain decode step does, so the draft would not "
                         "be exact")


def _check_kv_cache_dtype(values: dict[str, Any]) -> None:
    """A format the engine stores, and the options it takes (KVFormat.check_options: sink and tail rows only
    where it has them); ValueError naming the options otherwise. The combinations that need the checkpoint
    are checked with it (KVFormat.check_engine)."""
    fmt = parse_kv_cache_dtype(values["kv_cache_dtype"])
    for option in ("kv_sink_tokens", "kv_tail_tokens"):
        tokens = values.get(option, 0)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"{option} must be an integer >= 0, got {tokens!r}")
    rotation = values.get("kv_rotation", True)
    if not isinstance(rotation, bool):
        raise ValueError(f"kv_rotation must be True or False, got {rotation!r}")
    fmt.check_options(values)


def draft_loops(speculative: object, loops: int | None = None) -> int:
    """d of speculative="loops:d", checked: 1 <= d <= loops - 1 once the loop count is known."""
    kind, _, value = speculative.partition(":") if isinstance(speculative, str) else ("", "", "")
    if kind != "loops" or not value.isdigit():
        raise ValueError(f"speculative must be 'loops:d' (draft with the first d loops), got {speculative!r}")
    d = int(value)
    if d < 1 or (loops is not None and d > loops - 1):
        bound = "the loop count - 1" if loops is None else f"{loops - 1} (this engine runs {loops} loops)"
        raise ValueError(f"speculative={speculative!r}: d must be in 1..{bound}")
    return d


def _check_speculative(values: dict[str, Any]) -> None:
    speculative, k = values.get("speculative"), values.get("num_speculative_tokens")
    if speculative is not None:
        draft_loops(speculative)
        if values.get("kv_sharing") == "last":
            raise ValueError(f"speculative={speculative!r} cannot be combined with kv_sharing='last' yet: "
                             f"a rejected draft's K/V would be shared with the tokens after it")
    if k is not None:
        _check_positive("num_speculative_tokens", k)
        if speculative is None:
            raise ValueError("num_speculative_tokens needs speculative='loops:d'")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu' or 'cuda')") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device.type!r} is not supported; use 'cpu' or 'cuda'")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: LoopedConfig, device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's half dtype on CUDA, float32 on CPU (where bf16 matmuls are slow)."""
    _check_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if config.torch_dtype == "float32" else DTYPES[config.torch_dtype]
    return DTYPES[dtype]


def _check_dtype(dtype: object) -> None:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
    elif not isinstance(dtype, str) or (dtype != "auto" and dtype not in DTYPES):
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, float16 or bfloat16")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
