"""The test oracle: a deliberately plain, dense, fp32 Ouro, written from docs/ouro.md alone.

No cache, no paging, no fusion: every call recomputes the whole sequence from the raw HF-named
tensors. Also HF's exit semantics (docs/ouro.md §4): the exit pdf, Q-exit, exit_at_step, weighted logits,
and the remote code's own Q-exit in the model dtype (hf).
`decode` is the one stateful path: token by token with an explicit K/V list per (loop, layer) and
position, for the rules that change what later tokens read (early:Q's copy-forward, kv_sharing="last").
`decode_in_calls` is its sibling for the KV layouts that keep fewer loops than the model runs (a ring of
K loops, compress:k) and so depend on which tokens were computed together: call by call, as the engine's
steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_hf_tensors(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return {k: v.to(dtype) for k, v in tensors.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [S, heads, D]; NeoX rotate-half over all D dims."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).to(x.dtype) / d))
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def exit_pdf(gate_logits: torch.Tensor) -> torch.Tensor:
    """[T] gate logits -> [T] exit probabilities: p(t) = lambda_t * S_{t-1}; the last loop takes the rest."""
    lam = torch.sigmoid(gate_logits.double())
    survival = 1.0
    pdf = []
    for t in range(len(lam)):
        if t == len(lam) - 1:
            pdf.append(survival)
        else:
            pdf.append(lam[t].item() * survival)
            survival *= 1.0 - lam[t].item()
    return torch.tensor(pdf, dtype=torch.float64)


def threshold_exit_loop(gate_logits: torch.Tensor, q: float) -> int:
    """HF's Q-exit: the first loop whose cumulative exit probability reaches q; q >= 1 means the last."""
    if q >= 1.0:
        return len(gate_logits) - 1
    cdf = 0.0
    for t, p in enumerate(exit_pdf(gate_logits).tolist()):
        cdf += p
        if cdf >= q:
            return t
    return len(gate_logits) - 1


def hf_exit_loop(gate_logits: torch.Tensor, q: float | None) -> int:
    """The official remote code's Q-exit, for one token: its gate logits [T] stay in their own (the model's)
    dtype through sigmoid, p(t) = lambda_t * S_{t-1} and S_t = S_{t-1} * (1 - lambda_t) (the last loop takes
    S_{T-2}); the CDF is torch.cumsum of those p, as HF sums them, and is compared with q in that dtype too
    (torch rounds a Python float to the tensor's dtype: in bf16, q = 0.9 is 0.8984375). The first loop whose
    CDF >= q reads out, else the last. q None: HF has no threshold and reads out the last loop."""
    loops = len(gate_logits)
    if q is None:
        return loops - 1
    survival = torch.ones((), dtype=gate_logits.dtype)
    pdf = []
    for t in range(loops):
        lam = torch.sigmoid(gate_logits[t])
        pdf.append(lam * survival if t < loops - 1 else survival)
        survival = survival * (1.0 - lam)
    for t, reached in enumerate((torch.cumsum(torch.stack(pdf), dim=0) >= q).tolist()):
        if reached:
            return t
    return loops - 1


class ReferenceOuro:
    def __init__(self, model_dir: str | Path, loops: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        """dtype float64 gives the exact answer that fp32 runs (the oracle's own, the engine's) round."""
        model_dir = Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_hf_tensors(model_dir, dtype)
        self.loops = loops or self.cfg["total_ut_steps"]
        self.layers = self.cfg["num_hidden_layers"]
        self.heads = self.cfg["num_attention_heads"]
        self.kv_heads = self.cfg.get("num_key_value_heads", self.heads)
        self.head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.heads
        self.eps = self.cfg["rms_norm_eps"]
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def qkv(self, x: torch.Tensor, i: int, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w, p = self.w, f"model.layers.{i}.self_attn."
        s = x.shape[0]
        q = rope((x @ w[p + "q_proj.weight"].T).view(s, self.heads, self.head_dim), positions,
                 self.cfg["rope_theta"])
        k = rope((x @ w[p + "k_proj.weight"].T).view(s, self.kv_heads, self.head_dim), positions,
                 self.cfg["rope_theta"])
        v = (x @ w[p + "v_proj.weight"].T).view(s, self.kv_heads, self.head_dim)
        return q, k, v

    def attention(self, x: torch.Tensor, i: int, positions: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.self_attn."
        s = x.shape[0]
        q, k, v = self.qkv(x, i, positions)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)
        return out @ w[p + "o_proj.weight"].T

    def mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        w, p = self.w, f"model.layers.{i}.mlp."
        gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T

    def loop_states(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-norm hidden states [T, S, H] and gate logits [T, S] of every loop."""
        w, eps = self.w, self.eps
        positions = torch.arange(len(ids))
        h = w["model.embed_tokens.weight"][torch.tensor(ids)]
        states, gates = [], []
        for _ in range(self.loops):
            for i in range(self.layers):
                p = f"model.layers.{i}."
                a = self.attention(rms_norm(h, w[p + "input_layernorm.weight"], eps), i, positions)
                h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
                m = self.mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), i)
                h = h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
            h = rms_norm(h, w["model.norm.weight"], eps)
            states.append(h)
            gates.append(h @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
        return torch.stack(states), torch.stack(gates)

    def next_logits(self, ids: list[int], policy: str = "full") -> torch.Tensor:
        """Logits for the token after `ids` under an exit policy: full, step:K, threshold:Q, weighted, hf."""
        states, gates = self.loop_states(ids)
        return self.readout(states[:, -1], gates[:, -1], policy)

    def readout(self, last: torch.Tensor, gate: torch.Tensor, policy: str) -> torch.Tensor:
        """One token's logits from its per-loop states [T, H] and gate logits [T]."""
        if policy == "full":
            return last[-1] @ self.lm_head.T
        kind, _, arg = policy.partition(":")
        if kind == "step":
            return last[int(arg)] @ self.lm_head.T
        if kind == "threshold":
            return last[threshold_exit_loop(gate, float(arg))] @ self.lm_head.T
        if kind == "hf":
            return last[hf_exit_loop(gate, self.hf_threshold(arg))] @ self.lm_head.T
        if kind == "weighted":
            pdf = exit_pdf(gate).float()
            return sum(pdf[t] * (last[t] @ self.lm_head.T) for t in range(self.loops))
        raise ValueError(f"unknown policy {policy!r}")

    def hf_threshold(self, arg: str) -> float | None:
        """hf:Q's Q, or for plain hf the config's early_exit_threshold (HF's class default 1.0 if absent)."""
        return float(arg) if arg else self.cfg.get("early_exit_threshold", 1.0)

    def greedy(self, ids: list[int], max_new_tokens: int, policy: str = "full") -> list[int]:
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(self.next_logits(ids + out, policy).argmax()))
        return out

    def decode(self, prompt: list[int], max_new_tokens: int, policy: str = "full",
               kv_sharing: str = "none") -> tuple[list[int], list[dict]]:
        """Greedy tokens and per-token traces, one token at a time, keeping kv[t][l][position] = (k, v).

        Prompt tokens run every loop and keep their own K/V. Under early:Q a generated token stops after
        the first loop t < T-1 whose exit CDF reaches Q (Q < 1) and kv[t'][l][pos] for t' > t become
        copies of kv[t][l][pos]; it reads out at that loop (a token that ran every loop reads out at its
        Q-exit loop). Under kv_sharing="last" a token reads an earlier *generated* token's kv[T-1][l]
        (its last loop's K/V, or the copy of its exit loop's) at every loop; it reads its own loop-t K/V.
        Other policies only choose the readout (self.readout). A trace is {exit_pdf (one entry per loop
        run), exit_loop (None for weighted), top_token_ids (each loop's argmax)}.
        """
        kind, _, arg = policy.partition(":")
        early_q = float(arg) if kind == "early" else None
        kv = [[[] for _ in range(self.layers)] for _ in range(self.loops)]
        ids, out, traces = list(prompt), [], []
        for pos in range(len(prompt) + max_new_tokens - 1):
            generated = pos >= len(prompt)
            states, gates = self.token_loops(ids[pos], pos, kv, len(prompt), kv_sharing,
                                             early_q if generated else None)
            if pos < len(prompt) - 1:
                continue
            if early_q is not None:
                exit_loop = len(gates) - 1 if len(gates) < self.loops else threshold_exit_loop(gates, early_q)
                logits = states[exit_loop] @ self.lm_head.T
            else:
                logits = self.readout(states, gates, policy)
                exit_loop = self.loops - 1 if kind == "full" else None if kind == "weighted" else \
                    int(arg) if kind == "step" else hf_exit_loop(gates, self.hf_threshold(arg)) \
                    if kind == "hf" else threshold_exit_loop(gates, float(arg))
            padded = torch.cat([gates, gates.new_zeros(self.loops - len(gates))])
            traces.append({"exit_pdf": exit_pdf(padded)[:len(gates)].tolist(), "exit_loop": exit_loop,
                           "top_token_ids": [int((h @ self.lm_head.T).argmax()) for h in states]})
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        return out, traces

    def layer(self, h: torch.Tensor, i: int, position: torch.Tensor, store: list,
              seen: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        """Layer i on one token's state h [1, H] at `position` [1]: its K/V appended to `store`, its query
        attending over seen() (the (K, V) pairs it reads, itself last), the sandwich norms around attention
        and MLP."""
        w, eps, p = self.w, self.eps, f"model.layers.{i}."
        q, k, v = self.qkv(rms_norm(h, w[p + "input_layernorm.weight"], eps), i, position)
        store.append((k[0], v[0]))
        pairs = seen()
        keys = torch.stack([k for k, _ in pairs]).repeat_interleave(self.heads // self.kv_heads, 1)
        values = torch.stack([v for _, v in pairs]).repeat_interleave(self.heads // self.kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", q[0], keys) / math.sqrt(self.head_dim)
        a = torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(1, -1)
        a = a @ w[p + "self_attn.o_proj.weight"].T
        h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
        m = self.mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), i)
        return h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)

    def token_loops(self, token: int, pos: int, kv: list, num_prompt: int, kv_sharing: str,
                    early_q: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's loops: post-norm states [t, H] and gate logits [t] of the loops it ran."""
        w, eps = self.w, self.eps
        position = torch.tensor([pos])
        h = w["model.embed_tokens.weight"][token][None]
        states, gates = [], []
        for t in range(self.loops):
            for i in range(self.layers):
                def seen(i: int = i, t: int = t) -> list[tuple[torch.Tensor, torch.Tensor]]:
                    shared = kv_sharing == "last"
                    return [kv[self.loops - 1][i][j] if shared and num_prompt <= j < pos else kv[t][i][j]
                            for j in range(pos + 1)]

                h = self.layer(h, i, position, kv[t][i], seen)
            h = rms_norm(h, w["model.norm.weight"], eps)
            states.append(h[0])
            gates.append(h[0] @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
            if early_q is not None and early_q < 1.0 and t < self.loops - 1 and exit_cdf(gates) >= early_q:
                for later in range(t + 1, self.loops):
                    for i in range(self.layers):
                        kv[later][i].append(kv[t][i][pos])
                break
        return torch.stack(states), torch.stack(gates)


    def decode_in_calls(self, prompt: list[int], max_new_tokens: int, ring_loops: int | None = None,
                        prompt_calls: list[int] | None = None, early_q: float | None = None) -> list[int]:
        """Greedy tokens computed call by call: the prompt in calls of prompt_calls tokens (default: one
        call), then each generated token in a call of its own. K/V is kept per (ring loop, layer, position):
        loop t writes and reads ring loop t mod K (K = ring_loops; default T, one per loop: the full layout).
        Within a call all its tokens write a loop's K/V before any of them reads it, so they read each other
        at that loop; a token of an earlier call is read at its last write to that ring loop. Under early:Q
        (generated tokens only, as `decode`) a token that stops after loop t leaves its loop-t K/V in the
        ring loops after t that it never wrote, t+1..K-1 (latest): the deepest K/V it has of that layer."""
        ring = ring_loops or self.loops
        kv = [[{} for _ in range(self.layers)] for _ in range(ring)]
        calls = list(prompt_calls or [len(prompt)])
        if sum(calls) != len(prompt):
            raise ValueError(f"prompt_calls {calls} do not add up to the prompt's {len(prompt)} tokens")
        ids, out, start = list(prompt), [], 0
        while len(out) < max_new_tokens:
            end = start + (calls.pop(0) if calls else 1)
            generated = start >= len(prompt)
            states, gates = self.call_loops(ids, start, end, kv, ring, early_q if generated else None)
            start = end
            if end < len(prompt):
                continue
            stopped = len(gates) < self.loops
            exit_loop = len(gates) - 1 if stopped or early_q is None else threshold_exit_loop(gates, early_q)
            out.append(int((states[exit_loop] @ self.lm_head.T).argmax()))
            ids.append(out[-1])
        return out

    def call_loops(self, ids: list[int], start: int, end: int, kv: list, ring: int,
                   early_q: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One call over positions start..end-1: the last token's post-norm states [t, H] and gate logits
        [t] of the loops it ran (early_q: a one-token call may stop early)."""
        w, eps = self.w, self.eps
        positions = torch.arange(start, end)
        h = w["model.embed_tokens.weight"][torch.tensor(ids[start:end])]
        group = self.heads // self.kv_heads
        states, gates = [], []
        for t in range(self.loops):
            for i in range(self.layers):
                p = f"model.layers.{i}."
                q, k, v = self.qkv(rms_norm(h, w[p + "input_layernorm.weight"], eps), i, positions)
                plane = kv[t % ring][i]
                for j, pos in enumerate(range(start, end)):
                    plane[pos] = (k[j], v[j])
                keys = torch.stack([plane[j][0] for j in range(end)]).repeat_interleave(group, 1)
                values = torch.stack([plane[j][1] for j in range(end)]).repeat_interleave(group, 1)
                scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.head_dim)
                causal = positions[:, None] >= torch.arange(end)[None, :]
                scores = scores.masked_fill(~causal, float("-inf"))
                a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(end - start, -1)
                a = a @ w[p + "self_attn.o_proj.weight"].T
                h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
                m = self.mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), i)
                h = h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
            h = rms_norm(h, w["model.norm.weight"], eps)
            states.append(h[-1])
            gates.append(h[-1] @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
            if early_q is not None and early_q < 1.0 and t < self.loops - 1 and exit_cdf(gates) >= early_q:
                for later in range(t + 1, ring):
                    for i in range(self.layers):
                        kv[later][i][start] = kv[t % ring][i][start]
                break
        return torch.stack(states), torch.stack(gates)


def exit_cdf(gate_logits: list[torch.Tensor]) -> float:
    """The exit CDF after the loops run so far, none of them the last: sum_t lambda_t S_{t-1}."""
    survival, cdf = 1.0, 0.0
    for g in gate_logits:
        lam = torch.sigmoid(g.double()).item()
        cdf += lam * survival
        survival *= 1.0 - lam
    return cdf
