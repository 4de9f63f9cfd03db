"""The Huginn test oracle: a deliberately plain, dense Huginn written from docs/huginn.md alone, over the raw
HF-named tensors (q/k rows in checkpoint order, the adjacent-pair RoPE as the official code computes it).

Nothing survives from one token to the next: every token recomputes the whole sequence from its ids.
`logits` and `greedy` run the sequence as one group: every position through every layer together, dense
causal attention (fixed depth). `generate` runs the prompt as one group, then each later token alone, as the
official generate loops do, and keeps within the pass every position's K/V at every layer application, so
that the rules for a token that ran fewer recurrences than a later one are written out rather than implied
by a cache: `read_recurrence` (the cache strategies latest and compress:k), the warm start (normalized or
raw), and per-token adaptive exits with model/exit_criteria.py (or scripted exit steps). Prompt tokens run
every recurrence and never exit (the official do_not_exit_in_prefill=True).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from model.exit_criteria import ExitCriterion
from tests.reference import load_hf_tensors, rms_norm

WARM_STARTS = (None, "normalized", "raw")


def rope_adjacent(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [S, heads, D]: pair (2j, 2j+1) turned by position * base^(-2j/D), angles in fp32 (the official
    table), the rotation in x's dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = (positions.float()[:, None] * inv_freq[None, :]).to(x.dtype)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def read_recurrence(strategy: str, ran: int, recurrence: int, core_layers: int) -> int:
    """Which recurrence's K/V (0-based) a query at `recurrence` reads of an earlier token outside its group
    that ran `ran` recurrences (its own group reads the same recurrence: the official prefill).

    latest: the same recurrence, or the token's deepest if it stopped before (official latest-m4).
    compress:k: a ring of k core slots, k / core_layers recurrences deep (official compress-s{k}); the query
    reads ring row recurrence % depth, which holds the last recurrence the token wrote there; a row the
    token never reached falls back to its highest row below, its deepest recurrence (latest-m4 over ring
    rows, as the official combination does)."""
    if strategy == "latest":
        return min(recurrence, ran - 1)
    depth = int(strategy.partition(":")[2]) // core_layers
    row = recurrence % depth
    if ran > row:
        return row + depth * ((ran - 1 - row) // depth)
    return ran - 1


@dataclasses.dataclass
class Generation:
    """Greedy tokens; steps[n]: the recurrences behind token n's logits (the prompt's for the first);
    checks[n]: (loop, value) of each checked loop of that token (empty for the first)."""

    tokens: list[int]
    steps: list[int]
    checks: list[list[tuple[int, float]]]


@dataclasses.dataclass
class Pass:
    logits: torch.Tensor  # [V], the last position's
    ran: dict[int, int]  # position -> recurrences run
    checks: dict[int, list[tuple[int, float]]]  # generated position -> (loop, value) per checked loop


class ReferenceHuginn:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_hf_tensors(model_dir, dtype)
        self.hidden, self.heads = cfg["n_embd"], cfg["n_heads"]
        self.head_dim = self.hidden // self.heads
        self.prelude, self.core, self.coda = (cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"],
                                              cfg["n_layers_in_coda"])
        self.eps, self.base = cfg["norm_eps"], cfg["rope_base"]
        self.embed_scale = cfg["init_values"]["embed_scale"]
        self.vocab = cfg.get("padded_vocab_size", cfg["vocab_size"])
        tied = cfg.get("tie_embeddings", True)
        self.head = self.w["transformer.wte.weight" if tied else "lm_head.weight"]

    def block(self, prefix: str, x: torch.Tensor, positions: torch.Tensor,
              past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
        """One sandwich block over a group of consecutive positions, which attends to `past` (the earlier
        positions' K/V as this layer reads them, [P, heads, D] each) and causally to itself. Returns the
        block's output and the group's (k, v)."""
        w, eps, s = self.w, self.eps, x.shape[0]
        h = rms_norm(x, w[prefix + "norm_1.weight"], eps)
        q, k, v = (h @ w[prefix + "attn.Wqkv.weight"].T).view(s, 3, self.heads, self.head_dim).unbind(1)
        if prefix + "attn.qk_bias" in w:
            q, k = q + w[prefix + "attn.qk_bias"][0, 0], k + w[prefix + "attn.qk_bias"][1, 0]
        q, k = rope_adjacent(q, positions, self.base), rope_adjacent(k, positions, self.base)
        earlier = 0 if past is None else past[0].shape[0]
        keys = k if past is None else torch.cat([past[0], k])
        values = v if past is None else torch.cat([past[1], v])
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.head_dim)
        visible = torch.arange(earlier + s)[None, :] <= earlier + torch.arange(s)[:, None]
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
        x = rms_norm(attn.reshape(s, -1) @ w[prefix + "attn.proj.weight"].T + x, w[prefix + "norm_2.weight"],
                     eps)
        h = rms_norm(x, w[prefix + "norm_3.weight"], eps)
        gate, up = (h @ w[prefix + "mlp.fc.weight"].T).chunk(2, -1)
        mlp = (torch.nn.functional.silu(gate) * up) @ w[prefix + "mlp.proj.weight"].T
        return rms_norm(mlp + x, w[prefix + "norm_4.weight"], eps), (k, v)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["transformer.ln_f.weight"], self.eps)

    def logits(self, ids: list[int], num_steps: int) -> torch.Tensor:
        """[S, V] logits of every position, the sequence as one group, zero initial states."""
        return self.run(ids, len(ids), num_steps, "latest", all_logits=True).logits

    def greedy(self, prompt: list[int], max_new_tokens: int, num_steps: int) -> list[int]:
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(self.logits(prompt + out, num_steps)[-1].argmax()))
        return out

    def generate(self, prompt: list[int], max_new_tokens: int, num_steps: int, strategy: str = "latest",
                 criterion: ExitCriterion | None = None, exit_steps: list[int] | None = None,
                 warm_start: str | None = None) -> Generation:
        """Greedy tokens, the prompt as one group and each generated token alone. A generated token exits by
        `criterion`, or runs exit_steps[n] recurrences (token n's input is generated token n - 1: the
        list starts with the first generated token's input), or runs all num_steps."""
        out: list[int] = []
        last = None
        for _ in range(max_new_tokens):
            last = self.run(prompt + out, len(prompt), num_steps, strategy, criterion, exit_steps, warm_start)
            out.append(int(last.logits.argmax()))
        positions = range(len(prompt), len(prompt) + max_new_tokens - 1)
        return Generation(out, [num_steps] + [last.ran[p] for p in positions],
                          [[]] + [last.checks.get(p, []) for p in positions])

    def run(self, ids: list[int], prompt_len: int, num_steps: int, strategy: str,
            criterion: ExitCriterion | None = None, exit_steps: list[int] | None = None,
            warm_start: str | None = None, all_logits: bool = False) -> Pass:
        """One pass over the whole sequence from its ids: the first prompt_len positions as one group at full
        depth, then each later position alone."""
        if strategy != "latest" and not (strategy.startswith("compress:") and
                                         int(strategy.partition(":")[2]) % self.core == 0):
            raise ValueError(f"strategy must be latest or compress:k with k a multiple of {self.core}")
        if warm_start not in WARM_STARTS:
            raise ValueError(f"warm_start must be one of {WARM_STARTS}, got {warm_start!r}")
        kv: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        ran: dict[int, int] = {}
        checks: dict[int, list[tuple[int, float]]] = {}
        last_state = None
        groups = [range(0, prompt_len)] + [range(p, p + 1) for p in range(prompt_len, len(ids))]
        for group in groups:
            generated = group.start >= prompt_len
            positions = torch.tensor(list(group))

            def attend(prefix: str, x: torch.Tensor, key: tuple, recurrence: int | None = None
                       ) -> torch.Tensor:
                past = None
                if group.start:
                    read = [key if recurrence is None else
                            ("core", read_recurrence(strategy, ran[p], recurrence, self.core), key[2])
                            for p in range(group.start)]
                    pairs = [kv[r][p] for p, r in enumerate(read)]
                    past = (torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]))
                x, (k, v) = self.block(prefix, x, positions, past)
                for i, p in enumerate(group):
                    kv.setdefault(key, {})[p] = (k[i], v[i])
                return x

            x = self.w["transformer.wte.weight"][torch.tensor(ids[group.start:group.stop])] * self.embed_scale
            for j in range(self.prelude):
                x = attend(f"transformer.prelude.{j}.", x, ("prelude", j))
            e = x
            state = torch.zeros_like(e)
            if generated and warm_start is not None:
                state = (self.final_norm(last_state) if warm_start == "normalized" else last_state)[-1:]
            states = []
            memory = criterion.start(state, self.vocab) if criterion is not None and generated else None
            exit_loop = None
            token = group.start - prompt_len
            for i in range(num_steps):
                x = torch.cat([state, e], dim=-1) @ self.w["transformer.adapter.weight"].T
                for layer in range(self.core):
                    x = attend(f"transformer.core_block.{layer}.", x, ("core", i, layer), recurrence=i)
                state = x
                states.append(state)
                for p in group:
                    ran[p] = i + 1
                if not generated:
                    continue
                if exit_steps is not None and i + 1 >= exit_steps[token]:
                    exit_loop = i
                    break
                if criterion is not None and criterion.is_checked(i):
                    observed = self.readout(state, attend) if criterion.reads_logits else state
                    exits, values, memory = criterion.check(memory, observed)
                    checks.setdefault(group.start, []).append((i, float(values[0])))
                    if bool(exits[0]):
                        exit_loop = i
                        break
            if exit_loop is None:
                exit_loop = criterion.readout_loop(num_steps) if criterion is not None and generated \
                    else num_steps - 1
            last_state = state
            readout_state = states[exit_loop] if states else state
            logits = self.readout(readout_state, attend)
        return Pass(logits if all_logits else logits[-1], ran, checks)

    def readout(self, state: torch.Tensor, attend) -> torch.Tensor:
        """Logits: ln_f, the coda (its K/V stored for the group, replacing an earlier readout's), ln_f, the
        head."""
        x = self.final_norm(state)
        for c in range(self.coda):
            x = attend(f"transformer.coda.{c}.", x, ("coda", c))
        return self.final_norm(x) @ self.head.T
