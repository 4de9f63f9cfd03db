"""Train the embedded tiny Ouro from scratch, with model/ouro.py itself and Ouro's stage-I loss.

    python -m examples.train_tiny --out DIR [--preset toy|full] [--seed 0] [--steps N] [--device cuda]

Writes an HF-layout checkpoint that `Engine(DIR)` loads, plus results.json (command, seed, loss
curves, held-out task accuracy per loop count). It owns the synthetic corpus and the task split that
examples/loops_matter.py and the tests regenerate; it does not own the model code.

Data, generated here, reproducibly and offline, all of it written for this file (so it may be
redistributed with the repository):
- English from a small story grammar (TinyStories-like sentences over a few hundred words), plus a few
  sentences about looped models so that the engine's default prompt gets an on-topic continuation.
  Chosen over the docstrings the Python installation carries because those change between Python
  versions (the corpus would not be reproducible) and because a 4M-parameter model trained for minutes
  learns a template grammar well enough to write fluent text, while docstrings give it gibberish.
- Addition written most-significant digit first, "4821+3907=8728". The first answer digit depends on
  the whole carry chain, so the answer needs depth; that is the task where loops should matter.
  Pairs whose unordered operands hash into the held-out bucket never appear in training.
- ChatML conversations that ask for a sum or a story, so `engine.py generate --chat` works.

Objective (docs/ouro.md §4, paper stage I): per token, sum_t p(t) CE_t - beta H(p), with p the exit pdf
of the gate. beta starts at 1 and falls to 0.05 over the first half, so the exit distribution stays
spread while the deeper loops learn: early on the first loop has the lowest loss, and a small beta
from step 0 lets p collapse onto it, which then leaves the later loops' readouts untrained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.config import OuroConfig
from model.loader import load_model
from model.ouro import OuroForCausalLM
from model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, hf_config

LOOPS = 4
MAX_CHECKPOINT_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    max_digits: int
    tokenizer_docs: int
    beta: float = 0.05
    beta_start: float = 1.0
    log_every: int = 50
    print_every: int = 200
    eval_every: int = 500


PRESETS = {
    "toy": Preset(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                  intermediate_size=192, vocab_size=384, seq_len=64, batch_size=16, steps=40, lr=3e-3,
                  max_digits=2, tokenizer_docs=300, log_every=5, print_every=10, eval_every=20),
    "full": Preset(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=32,
                   intermediate_size=768, vocab_size=2048, seq_len=256, batch_size=64, steps=4800, lr=2e-3,
                   max_digits=4, tokenizer_docs=20000),
}

# -- corpus -----------------------------------------------------------------------------------------

NAMES = [("Tom", "he", "his"), ("Lily", "she", "her"), ("Max", "he", "his"), ("Mia", "she", "her"),
         ("Ben", "he", "his"), ("Sara", "she", "her"), ("Sam", "he", "his"), ("Anna", "she", "her"),
         ("Leo", "he", "his"), ("Zoe", "she", "her"), ("Jack", "he", "his"), ("Emma", "she", "her")]
ANIMALS = ["cat", "dog", "bird", "fox", "rabbit", "bear", "frog", "duck", "owl", "mouse", "turtle", "horse"]
ADJECTIVES = ["little", "happy", "sleepy", "brave", "kind", "shy", "curious", "clever", "tiny", "friendly",
              "funny", "gentle"]
PLACES = ["park", "garden", "forest", "river", "beach", "farm", "hill", "library", "kitchen", "lake",
          "school", "market"]
THINGS = ["red ball", "blue kite", "big book", "shiny stone", "green apple", "toy boat", "old map",
          "small box", "warm hat", "yellow flower", "silver key", "paper star"]
HOBBIES = ["play in the sun", "read books", "sing songs", "climb trees", "paint pictures",
           "look at the stars", "bake cakes", "swim in the lake", "dance in the rain", "build tall towers",
           "count the clouds", "fly a kite"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud", "surprised", "calm"]
TIMES = ["morning", "afternoon", "evening", "sunny day", "rainy day", "cold night"]
SAYINGS = ["Can I play with you?", "I am lost. Can you help me?", "Let us be friends!",
           "What a beautiful day!", "Thank you for your help.", "Look at this!", "Where are you going?",
           "I am hungry."]
LOOP_FACTS = [
    "A looped language model applies the same layers again and again.",
    "Each loop reads the hidden state and makes it a little better.",
    "After every loop, a small gate decides whether the model can stop.",
    "Easy tokens can stop after one or two loops.",
    "Hard tokens, like the first digit of a long sum, need all four loops.",
    "The model keeps the keys and values of every loop in its own slot.",
    "More loops cost more time, but they give the model more room to think.",
]


def story(rng: random.Random) -> str:
    (name, he, his), (friend, _, _) = rng.sample(NAMES, 2)
    He = he.capitalize()
    animal, other = rng.sample(ANIMALS, 2)
    thing, gift = rng.sample(THINGS, 2)
    hobby, together = rng.sample(HOBBIES, 2)
    place, trip = rng.sample(PLACES, 2)
    opening = rng.choice([
        f"Once upon a time, there was a {rng.choice(ADJECTIVES)} {animal} named {name}.",
        f"{name} was a {rng.choice(ADJECTIVES)} {animal} who lived near the {place}.",
    ])
    outing = rng.choice([
        f"One {rng.choice(TIMES)}, {name} went to the {trip} with {his} friend {friend}.",
        f"One {rng.choice(TIMES)}, {name} found a {thing} in the {trip}.",
    ])
    events = [f"{He} saw a {rng.choice(ADJECTIVES)} {other} near a tree.",
              f"The {other} said, \"{rng.choice(SAYINGS)}\"",
              f"{name} felt {rng.choice(FEELINGS)}.",
              f"{friend} gave {name} a {gift}.",
              f"They decided to {together} together.",
              "It started to rain, so they went back home."]
    middle = rng.sample(events, rng.randint(1, 3))
    ending = rng.choice([f"At the end of the day, {name} was very {rng.choice(FEELINGS)}.",
                         f"From that day on, {name} and {friend} were best friends.", "The end."])
    return " ".join([opening, f"{He} liked to {hobby}.", outing, *middle, ending])


def loop_facts(rng: random.Random) -> str:
    start = 0 if rng.random() < 0.5 else rng.randrange(len(LOOP_FACTS))
    count = rng.randint(2, 4)
    return " ".join(LOOP_FACTS[(start + i) % len(LOOP_FACTS)] for i in range(count))


def is_held_out(a: int, b: int) -> bool:
    """The test split: unordered pairs of two multi-digit operands whose hash lands in bucket 0 of 10."""
    lo, hi = min(a, b), max(a, b)
    if lo < 10:
        return False
    x = ((lo * 1_000_003 + hi) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    return (x ^ (x >> 31)) % 10 == 0


def operand(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)


def train_pair(rng: random.Random, max_digits: int) -> tuple[int, int]:
    while True:
        a = operand(rng, rng.randint(1, max_digits))
        b = operand(rng, rng.randint(1, max_digits))
        if not is_held_out(a, b):
            return a, b


def test_pairs(seed: int, count: int, max_digits: int) -> list[tuple[int, int]]:
    """Held-out items, regenerable from the training seed; operands have 2..max_digits digits."""
    rng = random.Random(f"test-{seed}")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < count:
        a = operand(rng, rng.randint(2, max_digits))
        b = operand(rng, rng.randint(2, max_digits))
        if is_held_out(a, b) and (a, b) not in pairs:
            pairs.append((a, b))
    return pairs


def addition(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}\n"


def math_doc(rng: random.Random, max_digits: int) -> str:
    return "".join(addition(*train_pair(rng, max_digits)) for _ in range(rng.randint(4, 12)))


def chat_doc(rng: random.Random, max_digits: int) -> str:
    kind = rng.random()
    if kind < 0.6:
        a, b = train_pair(rng, max_digits)
        question, answer = f"What is {a}+{b}?", addition(a, b).strip()
    elif kind < 0.9:
        question, answer = "Tell me a story.", story(rng)
    else:
        question, answer = "What is a looped language model?", loop_facts(rng)
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def document(rng: random.Random, max_digits: int) -> str:
    """One document, ended by <|endoftext|>. About half the tokens are sums, a third stories."""
    kind = rng.random()
    if kind < 0.37:
        text = story(rng)
    elif kind < 0.87:
        text = math_doc(rng, max_digits)
    elif kind < 0.92:
        text = loop_facts(rng)
    else:
        text = chat_doc(rng, max_digits)
    return text + SPECIAL_TOKENS[0]


def build_tokenizer(vocab_size: int, docs: list[str]) -> Tokenizer:
    """Byte-level BPE; digits are always single tokens, so every number is spelled digit by digit."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


class TokenStream:
    """Packs freshly generated documents into [B, S+1] rows; every row starts at a document start,
    as an engine prompt does, and the document that overflows a row is cut."""

    def __init__(self, tokenizer: Tokenizer, seed: int, max_digits: int, chunk: int = 256) -> None:
        self.tokenizer, self.max_digits, self.chunk = tokenizer, max_digits, chunk
        self.rng = random.Random(f"train-{seed}")
        self.docs: Iterator[list[int]] = iter(())

    def next_doc(self) -> list[int]:
        doc = next(self.docs, None)
        if doc is None:
            texts = [document(self.rng, self.max_digits) for _ in range(self.chunk)]
            self.docs = iter([e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)])
            doc = next(self.docs)
        return doc

    def batch(self, batch_size: int, seq_len: int) -> np.ndarray:
        rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
        for i in range(batch_size):
            row: list[int] = []
            while len(row) <= seq_len:
                row += self.next_doc()
            rows[i] = row[:seq_len + 1]
        return rows


def answer_mask(inputs: np.ndarray, eq_id: int, newline_id: int) -> np.ndarray:
    """True where the target (the next token) belongs to a sum's answer: after '=' through the newline."""
    marker = np.where(inputs == eq_id, 1, np.where(inputs == newline_id, 0, -1))
    columns = np.arange(inputs.shape[1])[None, :]
    last = np.maximum.accumulate(np.where(marker >= 0, columns, -1), axis=1)
    state = np.take_along_axis(marker, np.maximum(last, 0), axis=1)
    return (last >= 0) & (state == 1)


# -- model and loss ---------------------------------------------------------------------------------

def dense_causal_attention(batch_size: int, seq_len: int):
    """The model's attention callable for [B*S] rows of B independent sequences; no KV is kept."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        # Under autocast the residual stream stays fp32, so the RoPE tables and thus q and k are fp32
        # while v is bf16: cast q and k to v's dtype so SDPA gets one dtype (and flash attention).
        q, k, v = (x.to(v.dtype).view(batch_size, seq_len, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(batch_size * seq_len, q.shape[1], q.shape[3])
    return attention


def run_model(model: OuroForCausalLM, ids: torch.Tensor):
    """ids [B, S] -> LoopStates over all B*S rows (hidden [T, B*S, H], gate logits [T, B*S])."""
    batch_size, seq_len = ids.shape
    positions = torch.arange(seq_len, device=ids.device).repeat(batch_size)
    return model(ids.reshape(-1), positions, dense_causal_attention(batch_size, seq_len))


def exit_pdf(gate_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, N] -> (p, log p) [T, N], docs/ouro.md §4: p(t) = lambda_t S_{t-1}, p(T) = S_{T-1}.
    Computed in log space, because 1 - sigmoid underflows long before logsigmoid(-x) does."""
    g = gate_logits.float()
    log_survival = torch.cumsum(F.logsigmoid(-g), 0)
    log_before = torch.cat([torch.zeros_like(g[:1]), log_survival[:-1]])
    log_p = torch.cat([F.logsigmoid(g[:-1]) + log_before[:-1], log_before[-1:]])
    return log_p.exp(), log_p


@dataclasses.dataclass(slots=True)
class LossParts:
    loss: torch.Tensor
    expected_ce: torch.Tensor       # mean over tokens of sum_t p(t) CE_t, the loss without its entropy term
    ce_by_loop: torch.Tensor        # [T] mean CE of each loop's readout over all tokens
    answer_ce_by_loop: torch.Tensor  # [T] the same over sum-answer tokens
    exit_pdf: torch.Tensor          # [T] mean exit probability over all tokens
    answer_exit_pdf: torch.Tensor   # [T] the same over sum-answer tokens


def stage_one_loss(model: OuroForCausalLM, ids: torch.Tensor, targets: torch.Tensor, answers: torch.Tensor,
                   beta: float) -> LossParts:
    states = run_model(model, ids)
    loops = states.hidden.shape[0]
    logits = model.compute_logits(states.hidden)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1).repeat(loops),
                         reduction="none").view(loops, -1)
    p, log_p = exit_pdf(states.gate_logits)
    entropy = -(p * log_p).sum(0)
    expected_ce = (p * ce).sum(0)
    loss = (expected_ce - beta * entropy).mean()
    mask = answers.reshape(-1)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        return LossParts(loss, expected_ce.mean(), ce.mean(1), (ce * mask).sum(1) / count, p.mean(1),
                         (p * mask).sum(1) / count)


def init_weights(model: OuroForCausalLM, gate_bias: float) -> None:
    """Normal(0, 0.02) matrices and embeddings, unit norms; the gate starts constant at
    lambda = sigmoid(gate_bias) for every token, so p starts spread over all loops."""
    for param in model.parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.02)
    torch.nn.init.zeros_(model.early_exit_gate.weight)
    torch.nn.init.constant_(model.early_exit_gate.bias, gate_bias)


def make_optimizer(model: OuroForCausalLM, lr: float, fused: bool) -> torch.optim.AdamW:
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    others = [p for n, p in model.named_parameters() if p.dim() != 2 or "embed" in n]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def lr_scale(progress: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    if progress < warmup:
        return progress / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def beta_at(progress: float, preset: Preset, anneal: float = 0.5) -> float:
    """Geometric decay from beta_start to beta over the first half of training, then constant."""
    frac = min(1.0, progress / anneal)
    return preset.beta_start * (preset.beta / preset.beta_start) ** frac


# -- evaluation --------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class ItemScores:
    """Teacher-forced predictions on held-out sums: correct [T, n, S] per loop readout, the answer
    positions [n, S], and the exit pdf [T, n, S]. For exact match this equals greedy decoding: a
    greedy run diverges exactly at the first wrong argmax, which teacher forcing also sees."""

    correct: torch.Tensor
    answer: torch.Tensor
    pdf: torch.Tensor

    def accuracy(self, loop: int) -> float:
        return (self.correct[loop - 1] | ~self.answer).all(1).float().mean().item()

    def exit_loops(self, q: float) -> torch.Tensor:
        """HF's Q-exit (docs/ouro.md §4): the first loop (0-based) whose exit CDF reaches q, else the last."""
        cdf = torch.cumsum(self.pdf, 0)
        return (cdf < q).sum(0).clamp(max=self.pdf.shape[0] - 1)

    def q_exit(self, q: float) -> tuple[float, float]:
        """(accuracy, mean loops used per answer token) when each token reads out at its Q-exit loop."""
        loops = self.exit_loops(q)
        correct = self.correct.gather(0, loops[None]).squeeze(0)
        accuracy = (correct | ~self.answer).all(1).float().mean().item()
        return accuracy, (loops[self.answer] + 1).float().mean().item()


@torch.no_grad()
def score_items(model: OuroForCausalLM, tokenizer: Tokenizer, pairs: list[tuple[int, int]],
                device: torch.device) -> ItemScores:
    prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False).ids for a, b in pairs]
    fulls = [tokenizer.encode(addition(a, b), add_special_tokens=False).ids for a, b in pairs]
    width = max(len(f) for f in fulls)
    ids = torch.zeros(len(pairs), width, dtype=torch.int64)
    answer = torch.zeros(len(pairs), width, dtype=torch.bool)
    for i, (prompt, full) in enumerate(zip(prompts, fulls)):
        ids[i, :len(full)] = torch.tensor(full)
        answer[i, len(prompt) - 1:len(full) - 1] = True
    ids, answer = ids.to(device), answer.to(device)
    states = run_model(model, ids)
    loops = states.hidden.shape[0]
    predicted = model.compute_logits(states.hidden).argmax(-1).view(loops, *ids.shape)
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    pdf, _ = exit_pdf(states.gate_logits)
    return ItemScores(predicted == targets, answer, pdf.view(loops, *ids.shape))


@torch.no_grad()
def story_exit_loops(model: OuroForCausalLM, tokenizer: Tokenizer, seed: int, count: int, q: float,
                     device: torch.device) -> float:
    """Mean Q-exit loop (1-based) over the tokens of held-out stories: how early easy text exits."""
    rng = random.Random(f"stories-{seed}")
    docs = [tokenizer.encode(story(rng), add_special_tokens=False).ids for _ in range(count)]
    width = min(len(d) for d in docs)
    ids = torch.tensor([d[:width] for d in docs], device=device)
    pdf, _ = exit_pdf(run_model(model, ids).gate_logits)
    cdf = torch.cumsum(pdf, 0)
    return ((cdf < q).sum(0).clamp(max=pdf.shape[0] - 1) + 1).float().mean().item()


# -- checkpoint ---------------------------------------------------------------------------------------

def hf_tensors(model: OuroForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, q/k/v and gate/up split back out of the fused projections."""
    config = model.config
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
           "model.early_exit_gate.weight": model.early_exit_gate.weight,
           "model.early_exit_gate.bias": model.early_exit_gate.bias, "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv_proj.weight.split([config.q_size, config.kv_size, config.kv_size])
        gate, up = layer.gate_up_proj.weight.chunk(2)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o_proj.weight,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.down_proj.weight})
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            out[p + norm + ".weight"] = getattr(layer, norm).weight
    return {name: t.detach().to("cpu", dtype).contiguous() for name, t in out.items()}


def storage_dtype(model: OuroForCausalLM) -> str:
    """float32 when the file fits in 16 MiB, else bfloat16 (what bf16 autocast multiplied with anyway)."""
    params = sum(p.numel() for p in model.parameters())
    return "float32" if params * 4 <= MAX_CHECKPOINT_BYTES else "bfloat16"


def save_checkpoint(model: OuroForCausalLM, tokenizer: Tokenizer, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(model, getattr(torch, config["torch_dtype"])), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [0, 2]},
                                                           indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0],
         "chat_template": CHAT_TEMPLATE, "model_max_length": config["max_position_embeddings"]},
        indent=2) + "\n")


# -- training -----------------------------------------------------------------------------------------

def flops_per_token(config: OuroConfig, seq_len: int) -> float:
    """Training FLOPs (6 per multiply-add parameter) for all loops, the per-loop lm_head and attention."""
    hidden, inter = config.hidden_size, config.intermediate_size
    layer = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden + 3 * hidden * inter
    loops, layers = config.total_ut_steps, config.num_hidden_layers
    attention = seq_len * config.q_size  # causal: S/2 keys on average, for QK^T and for PV
    return 6 * loops * (layers * (layer + attention) + config.vocab_size * hidden)


def rounded(values: torch.Tensor | list[float]) -> list[float]:
    return [round(float(v), 4) for v in values]


def build_model(preset: Preset, vocab_size: int, device: torch.device) -> tuple[OuroForCausalLM, dict]:
    """The float32 training model and the config.json it will be saved with."""
    shape = dict(hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
                 num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
                 num_key_value_heads=preset.num_attention_heads, head_dim=preset.head_dim,
                 vocab_size=vocab_size, max_position_embeddings=2048, rope_theta=10000.0)
    model = OuroForCausalLM(OuroConfig.from_dict(hf_config(shape, LOOPS, "float32"))).to(device)
    init_weights(model, gate_bias=-1.1)
    config = hf_config(shape, LOOPS, storage_dtype(model))
    config["eos_token_id"] = [0, 2]
    return model, config


def curve_entry(step: int, parts: LossParts, beta: float, rate: float, elapsed: float) -> dict:
    return {"step": step, "loss": round(parts.loss.item(), 4),
            "expected_ce": round(parts.expected_ce.item(), 4), "beta": round(beta, 4),
            "ce_by_loop": rounded(parts.ce_by_loop), "answer_ce_by_loop": rounded(parts.answer_ce_by_loop),
            "exit_pdf": rounded(parts.exit_pdf), "answer_exit_pdf": rounded(parts.answer_exit_pdf),
            "steps_per_s": round(rate, 2), "elapsed_s": round(elapsed, 1)}


def progress_line(entry: dict, tokens_per_step: int, flops: float) -> str:
    def short(values: list[float]) -> str:
        return " ".join(f"{v:.2f}" for v in values)
    tokens_per_s = entry["steps_per_s"] * tokens_per_step
    return (f"step {entry['step']:5d} loss {entry['loss']:.3f} E[ce] {entry['expected_ce']:.3f} "
            f"| ce/loop {short(entry['ce_by_loop'])} | answer ce/loop {short(entry['answer_ce_by_loop'])} "
            f"| answer p(exit) {short(entry['answer_exit_pdf'])} | {entry['steps_per_s']:.1f} steps/s "
            f"{tokens_per_s / 1e3:.0f}k tok/s {tokens_per_s * flops / 1e12:.1f} TFLOP/s "
            f"{entry['elapsed_s']:.0f}s")


@dataclasses.dataclass(slots=True)
class Trained:
    model: OuroForCausalLM  # float32 master weights, on the training device
    tokenizer: Tokenizer
    results: dict           # what results.json holds


def train(out: Path, preset_name: str = "toy", seed: int = 0, steps: int | None = None, device: str = "cpu",
          batch_size: int | None = None, time_budget: float = 0.0, command: str = "") -> Trained:
    """Train, save the checkpoint into `out`, evaluate the saved weights, write results.json.

    With a time budget, the LR and beta schedules follow max(step / steps, elapsed / budget), so a
    slower machine ends on time with a fully decayed LR; results.json says which limit ended it."""
    preset = PRESETS[preset_name]
    steps, batch_size, dev = steps or preset.steps, batch_size or preset.batch_size, torch.device(device)
    torch.manual_seed(seed)
    doc_rng = random.Random(f"tokenizer-{seed}")
    tokenizer = build_tokenizer(preset.vocab_size, [document(doc_rng, preset.max_digits)
                                                    for _ in range(preset.tokenizer_docs)])
    model, config = build_model(preset, tokenizer.get_vocab_size(), dev)
    optimizer = make_optimizer(model, preset.lr, fused=dev.type == "cuda")
    stream = TokenStream(tokenizer, seed, preset.max_digits)
    eq_id, newline_id = tokenizer.token_to_id("="), tokenizer.token_to_id("Ċ")  # Ċ: byte-level newline
    eval_pairs = test_pairs(seed, 256, preset.max_digits)
    params = sum(p.numel() for p in model.parameters())
    flops, tokens_per_step = flops_per_token(model.config, preset.seq_len), batch_size * preset.seq_len
    print(f"train_tiny: preset {preset_name}, {params / 1e6:.2f}M params, vocab {model.config.vocab_size}, "
          f"{LOOPS} loops x {preset.num_hidden_layers} layers, batch {batch_size} x {preset.seq_len}, "
          f"{steps} steps, time budget {time_budget:.0f}s, device {dev}", flush=True)

    curve: list[dict] = []
    eval_curve: list[dict] = []
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda")
    start = window_start = time.perf_counter()
    window_steps, stopped_by, step, progress = 0, "steps", 0, 0.0
    while progress < 1.0:
        rows = stream.batch(batch_size, preset.seq_len)
        answers = torch.from_numpy(answer_mask(rows[:, :-1], eq_id, newline_id)).to(dev, non_blocking=True)
        rows_t = torch.from_numpy(rows).to(dev, non_blocking=True)
        beta = beta_at(progress, preset)
        for group in optimizer.param_groups:
            group["lr"] = preset.lr * lr_scale(progress)
        with autocast:
            parts = stage_one_loss(model, rows_t[:, :-1], rows_t[:, 1:], answers, beta)
        optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, window_steps = step + 1, window_steps + 1
        elapsed = time.perf_counter() - start
        progress = step / steps
        if time_budget > 0 and elapsed / time_budget > progress:
            progress, stopped_by = elapsed / time_budget, "time"
        last = progress >= 1.0
        if step % preset.log_every == 0 or step == 1 or last:
            now = time.perf_counter()
            curve.append(curve_entry(step, parts, beta, window_steps / (now - window_start), elapsed))
            window_start, window_steps = now, 0
            if step % preset.print_every == 0 or step == 1 or last:
                print(progress_line(curve[-1], tokens_per_step, flops), flush=True)
        if step % preset.eval_every == 0 or last:
            with autocast:
                scores = score_items(model.eval(), tokenizer, eval_pairs, dev)
            model.train()
            eval_curve.append({"step": step, "accuracy_by_loops": [round(scores.accuracy(t), 4)
                                                                   for t in range(1, LOOPS + 1)]})
            print(f"step {step:5d} held-out accuracy (teacher-forced) by loops 1..{LOOPS}: "
                  f"{eval_curve[-1]['accuracy_by_loops']}", flush=True)
    train_seconds = time.perf_counter() - start

    save_checkpoint(model, tokenizer, config, out)
    results = {
        "seed": seed, "command": command, "preset": preset_name, "steps": steps, "steps_done": step,
        "stopped_by": stopped_by, "time_budget_s": time_budget, "batch_size": batch_size,
        "seq_len": preset.seq_len, "tokens_seen": step * tokens_per_step,
        "train_seconds": round(train_seconds, 1),
        "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "params": params, "beta": preset.beta, "beta_start": preset.beta_start,
        "lr": preset.lr, "final": curve[-1], "task": evaluate_saved(out, seed, preset.max_digits, dev),
        "curve": curve, "eval_curve": eval_curve,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out} after {step} steps, {train_seconds:.0f}s of training (ended by {stopped_by}); "
          f"held-out accuracy by loops: {results['task']['accuracy_by_loops']}", flush=True)
    return Trained(model.eval(), tokenizer, results)


HANDFUL = 20
TEST_ITEMS = 512


def evaluate_saved(out: Path, seed: int, max_digits: int, device: torch.device) -> dict:
    """Held-out accuracy of the *saved* weights (bf16-rounded if stored so), read back in float32."""
    config = OuroConfig.from_file(out / "config.json")
    model = load_model(out, config, device, torch.float32)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    pairs = test_pairs(seed, TEST_ITEMS, max_digits)
    scores = score_items(model, tokenizer, pairs, device)
    handful = score_items(model, tokenizer, pairs[:HANDFUL], device)
    return {"name": "addition", "format": "a+b=c, most significant digit first", "max_digits": max_digits,
            "test_items": TEST_ITEMS, "test_seed": seed,
            "accuracy_by_loops": {str(t): round(scores.accuracy(t), 4) for t in range(1, LOOPS + 1)},
            "handful": {"items": HANDFUL, "loops": LOOPS, "accuracy": round(handful.accuracy(LOOPS), 4)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--preset", default="toy", choices=sorted(PRESETS),
                        help="toy: seconds on CPU; full: minutes on one H200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per step (default: the preset's)")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds; if training runs slower than steps / budget, the LR schedule follows "
                             "wall time instead and training ends at the budget (0: off)")
    args = parser.parse_args()
    command = " ".join(["python", "-m", "examples.train_tiny", *sys.argv[1:]])
    train(Path(args.out), args.preset, args.seed, args.steps, args.device, args.batch_size, args.time_budget,
          command)


if __name__ == "__main__":
    main()
