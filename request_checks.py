"""A request's SamplingParams checked against the engine it is added to: its loop count, its exit policy on a
model without an exit gate, what self-speculation cannot take, and logprob counts. SamplingParams checks its
own fields (request.py); these are the checks that need the engine's options."""

from __future__ import annotations

import dataclasses

from engine_config import EngineConfig
from exit_policy import request_policy
from model.registry import policy_refusal
from request import SamplingParams

# SamplingParams fields that change a position's logits by the tokens before it, off at these values
HISTORY_FIELDS = (("min_tokens", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                  ("repetition_penalty", 1.0))


def checked_params(params: SamplingParams | None, config: EngineConfig, has_exit_gate: bool,
                   dense_kv: bool) -> SamplingParams:
    """A checked copy of the params (SamplingParams.validate again: a field may have been set since they were
    built), which the request keeps, so a later change to the caller's params never reaches it. dense_kv:
    the KV pool stores rows a request's early stop can copy forward (not KVarN's packed tiles)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    params = dataclasses.replace(params) if params is not None else SamplingParams()
    policy = request_policy(params.exit_policy, config.exit_policy, request_loops(params, config, dense_kv))
    if not has_exit_gate:
        refusal = policy_refusal(policy, "SamplingParams.exit_policy")
        if refusal is not None and params.exit_policy is not None:
            raise ValueError(refusal)
        if params.loop_trace and not policy.is_criterion:
            raise ValueError("SamplingParams.loop_trace traces the exit gate's per-loop probabilities, and "
                             "this model has no exit gate (under an exit criterion it traces each token's "
                             "loops and readout loop)")
    if config.speculative is not None:
        for name, off in HISTORY_FIELDS:
            if getattr(params, name) != off:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)!r} cannot be combined with "
                                 f"speculative={config.speculative!r} yet: it changes each position's logits "
                                 f"by the tokens before it, which a draft does not know yet")
    vocab_size = config.model.shape.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > vocab_size:
            raise ValueError(f"SamplingParams.{name}={getattr(params, name)} is more than the vocabulary "
                             f"({vocab_size} tokens)")
    return params


def request_loops(params: SamplingParams, config: EngineConfig, dense_kv: bool) -> int:
    """The loops a request with these params runs: SamplingParams.loops, at most the engine's (ValueError
    naming it), refused where the engine cannot stop a request's rows at its own loop count
    (docs/looped_controls.md, "Per-request loops"). Sets params.loops to None where it equals the engine's,
    so that such a request shares the prefix cache with requests that leave it unset."""
    loops = config.loops
    if params.loops is None or params.loops == loops:
        params.loops = None
        return loops
    if params.loops > loops:
        raise ValueError(f"SamplingParams.loops={params.loops} exceeds the engine's {loops} loops (its KV "
                         f"pool holds the slots of {loops}); start the engine with loops={params.loops}")
    refused = [
        (config.speculative is not None,
         f"speculative={config.speculative!r}: a speculative step drafts and verifies every row at the "
         f"engine's loop counts"),
        (config.exit_policy.can_exit,
         f"exit_policy={str(config.exit_policy)!r}: it stops generated tokens loop by loop itself; "
         f"per-request loops need an engine whose exit policy only reads out"),
        (config.kv_sharing != "none",
         f"kv_sharing={config.kv_sharing!r} yet: its shared generated-token location is not validated for "
         f"rows that stop before the engine's last loop"),
        (not dense_kv,
         f"kv_cache_dtype={config.kv_cache_dtype!r}: a row that stops early copies its K/V into its deeper "
         f"slots, which packed KVarN tiles cannot take"),
    ]
    for bad, reason in refused:
        if bad:
            raise ValueError(f"SamplingParams.loops={params.loops} cannot be combined with {reason}")
    return params.loops
