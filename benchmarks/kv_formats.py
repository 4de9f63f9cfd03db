"""Low-bit KV formats (cache/kvarn_format.py, cache/kvarn.py) measured before they enter the engine: capacity
at Ouro-1.4B's shape, and what each format does to the embedded tiny trained model's outputs. CPU.

    python -m benchmarks.kv_formats --out benchmarks/results/kv_formats.json
    python -m benchmarks.kv_formats --model <a checkpoint> --device cuda --dtype bfloat16 --out ...

Capacity: 4096-token sequences in a 64 GiB pool, per format and per high-precision side pool (sink, tail),
with and without kv_sharing="last" (generated tokens in L slots, not T x L), against bf16; byte accounting of
packed tiles, their fp16 scales and the side pool's rows.

Outputs: the tiny model (fp32) drives its loops itself with one PackedSequence per sequence as the attention
(cache/packed_sequence.py: K/V packed into tiles and read back through the codec, sink and tail rows in
high precision). The reference tokens are the engine's greedy tokens (dense KV), which the same loop with
the dense format reproduces (checked over the first 32). Each format is teacher-forced on the reference
tokens (in one call, which reads what token by token would), so every position's next-token distribution
has the same context: token-level KL(reference || format), mean and p99 per position bucket, and the greedy
agreement up to the first divergence (the first position whose argmax differs is where free-running greedy
output would first differ). Task accuracy: the addition task with a few-shot
prefix long enough for the prompt to fill tiles, free-running greedy under each format. With --model (say
the Ouro-1.4B-shape random checkpoint, on CUDA in bf16) the prompts are random tokens and there is no task.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

from benchmarks.common import ROOT, environment, write_results
from cache.kv_format import KVFormat
from cache.kv_formats import parse_kv_cache_dtype
from cache.packed_sequence import PackedSequence
from engine import DEFAULT_MODEL, Engine, SamplingParams

FORMATS = ["fp8_e4m3", "kvarn_k5v5_g64", "kvarn_k4v4_g64", "kvarn_k4v4_g128", "kvarn_k4v2_g64",
           "kvarn_k4v2_g128"]
# (sink, tail, bytes per side-pool value): the last bf16 row is KVarN's default; 1 byte: an fp8 side pool
SIDE_POOLS = [(0, 0, 2), (0, 64, 2), (64, 64, 2), (64, 256, 2), (64, 256, 1), (128, 1024, 2), (128, 1024, 1)]
BUCKETS = [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1 << 30)]
OURO_1_4B = dict(loops=4, layers=24, kv_heads=16, head_dim=128)


def capacity(budget_gib: float, sequence: int, prompt: int) -> list[dict]:
    """Sequences of `sequence` tokens (`prompt` of them prompt) that fit in the budget, per format, side pool
    and kv_sharing. Under kv_sharing="last" the generated tokens' tiles and side rows sit in L slots; the
    prompt's in T x L (the prompt/generated boundary is taken as a tile boundary)."""
    shape = OURO_1_4B
    slots, layers = shape["loops"] * shape["layers"], shape["layers"]
    budget = budget_gib * 2 ** 30
    bf16 = parse_kv_cache_dtype("bf16")

    def sequence_bytes(fmt: KVFormat, sink: int, tail: int, side: int, sharing: str) -> int:
        args = (shape["kv_heads"], shape["head_dim"])
        if sharing == "none":
            return fmt.sequence_bytes(sequence, slots, *args, sink=sink, tail=tail, high_precision_bytes=side)
        generated = sequence - prompt
        return (fmt.sequence_bytes(prompt, slots, *args, sink=sink, tail=0, high_precision_bytes=side)
                + fmt.sequence_bytes(generated, layers, *args, sink=0, tail=tail, high_precision_bytes=side))

    base = int(budget // sequence_bytes(bf16, 0, 0, 2, "none"))
    rows = []
    for sharing in ("none", "last"):
        for name in ["bf16", *FORMATS]:
            fmt = parse_kv_cache_dtype(name)
            for sink, tail, side in SIDE_POOLS if fmt.kind == "kvarn" else [(0, 0, 2)]:
                size = sequence_bytes(fmt, sink, tail, side, sharing)
                count = int(budget // size)
                rows.append({"kv_cache_dtype": name, "kv_sharing": sharing, "sink": sink, "tail": tail,
                             "side_pool": "fp8" if side == 1 else "bf16",
                             "mib_per_sequence": round(size / 2 ** 20, 1), "sequences": count,
                             "x_bf16": round(count / base, 2)})
    return rows


class LoopedDecoder:
    """The model's forward, all loops, last-loop readout (the engine's default policy), through one
    attention callable per sequence."""

    def __init__(self, model) -> None:
        self.model = model
        self.loops = model.config.total_ut_steps

    @torch.inference_mode()
    def logits(self, ids: list[int], start: int, attention) -> torch.Tensor:
        """Logits [n, V] of the n tokens `ids` at positions start.. (stored in `attention` as they run)."""
        model = self.model
        device = model.embed_tokens.weight.device
        h = model.embed_tokens(torch.tensor(ids, device=device))
        cos, sin = model.rotary(torch.arange(start, start + len(ids), device=device), h.dtype)
        for t in range(self.loops):
            h = model.run_loop(h, cos, sin, attention, t)
        return model.compute_logits(h).float()


def new_store(model, fmt: KVFormat, sink: int, tail: int) -> PackedSequence:
    config = model.config
    return PackedSequence(fmt, config.total_ut_steps * config.num_hidden_layers, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim, sink=sink, tail=tail,
                          device=model.embed_tokens.weight.device)


def greedy(decoder: LoopedDecoder, prompt: list[int], new_tokens: int, store: PackedSequence,
           stop: set[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Free-running greedy decode: the tokens and each step's log-probabilities."""
    logits = decoder.logits(prompt, 0, store)[-1]
    tokens, logprobs = [], []
    while len(tokens) < new_tokens:
        logprobs.append(torch.log_softmax(logits, -1))
        token = int(logits.argmax())
        tokens.append(token)
        if stop and token in stop:
            break
        logits = decoder.logits([token], len(prompt) + len(tokens) - 1, store)[-1]
    return tokens, logprobs


def teacher_forced(decoder: LoopedDecoder, prompt: list[int], tokens: list[int],
                   store: PackedSequence) -> list[torch.Tensor]:
    """Log-probabilities before each of `tokens`, feeding the given tokens (not the format's own), in one
    forward of prompt + tokens[:-1]. The same as feeding them one at a time: which positions a query reads in
    high precision depends on positions only (attention/packed_attention.py: high_precision), so a sequence
    read in one call or token by token reads the same values; one call packs and decodes each tile once
    instead of at every token."""
    logits = decoder.logits(prompt + tokens[:-1], 0, store)[len(prompt) - 1:]
    return list(torch.log_softmax(logits, -1))


def kl_rows(reference: list[list[torch.Tensor]], tokens: list[list[int]],
            measured: list[list[torch.Tensor]]) -> dict:
    kls, agreement = [], []
    for ref, toks, got in zip(reference, tokens, measured):
        kl = [float((r.exp() * (r - g)).sum()) for r, g in zip(ref, got)]
        kls.append(kl)
        first = next((i for i, (g, t) in enumerate(zip(got, toks)) if int(g.argmax()) != t), len(toks))
        agreement.append(first)
    buckets = {}
    for low, high in BUCKETS:
        values = sorted(v for kl in kls for v in kl[low:high])
        if values:
            buckets[f"{low}-{min(high, max(len(k) for k in kls))}"] = {
                "mean": float(sum(values) / len(values)),
                "p99": float(values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)])}
    every = [v for kl in kls for v in kl]
    return {"kl_mean": sum(every) / len(every), "kl_by_position": buckets,
            "agreement_tokens": agreement, "agreement_mean": sum(agreement) / len(agreement)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=64.0)
    parser.add_argument("--prompts", type=int, default=6, help="KL prompts (addition items with shots)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--shots", type=int, default=16, help="few-shot prefix of the task prompts (the tiny "
                        "model keeps its accuracy to about 300 tokens)")
    parser.add_argument("--accuracy-items", type=int, default=40)
    parser.add_argument("--side-pools", default="0:0,64:64", help="sink:tail pairs for the output rows")
    parser.add_argument("--model", default=None, help="a checkpoint with random prompts, no task accuracy "
                        "(default: the embedded tiny trained model on its addition task)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens, with --model")
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    results = {**environment(), "capacity": capacity(args.budget_gib, 4096, 512)}
    side_pools = [tuple(int(x) for x in pair.split(":")) for pair in args.side_pools.split(",")]
    task = ROOT / "benchmarks" / "tasks" / "addition.jsonl"
    items = [json.loads(line) for line in task.read_text().splitlines()]
    prefix = "".join(f"{item['prompt']}{item['answer']}\n" for item in items[:args.shots])
    task_mode = args.model is None
    results["new_tokens"] = args.new_tokens
    results["shots"] = args.shots if task_mode else None
    results["model"] = "embedded tiny trained model (fp32)" if task_mode else f"{args.model} ({args.dtype})"
    with Engine(args.model or DEFAULT_MODEL, device=args.device, dtype=args.dtype, verbose=False,
                max_num_seqs=1, max_model_len=1024 if task_mode else args.prompt_len + args.new_tokens + 8,
                ) as engine:
        model, tokenizer = engine.model, engine.tokenizer
        decoder = LoopedDecoder(model)
        if task_mode:
            kl_items = items[args.shots:args.shots + args.prompts]
            prompts = [tokenizer.encode(prefix + item["prompt"]) for item in kl_items]
        else:
            rng = random.Random(0)
            prompts = [[rng.randrange(3, engine.config.vocab_size) for _ in range(args.prompt_len)]
                       for _ in range(args.prompts)]
        results["prompt_tokens"] = [len(p) for p in prompts]
        # The reference tokens are the engine's greedy tokens in the model's dtype (fast: its own kernels and
        # graphs); the benchmark's loop, which the formats run through, must reproduce them.
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        ref_tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        dense = parse_kv_cache_dtype("auto")
        checked = min(32, args.new_tokens)
        loop_tokens, _ = greedy(decoder, prompts[0], checked, new_store(model, dense, 0, 0))
        same = next((i for i, (a, b) in enumerate(zip(loop_tokens, ref_tokens[0])) if a != b), checked)
        results["engine_agreement_tokens"] = same
        if args.dtype in ("float32", "fp32"):  # exact there; in half precision the kernels round otherwise
            assert same == checked, "the benchmark's loop does not reproduce the engine"
        # The reference's log-probabilities the way the formats' are taken (one teacher-forced call), so that
        # a KL measures the format, not a difference in how the rows were batched.
        ref_logprobs = [teacher_forced(decoder, p, t, new_store(model, dense, 0, 0))
                        for p, t in zip(prompts, ref_tokens)]
        stop = set(engine.config.eos_token_ids) | set(tokenizer.encode("\n"))
        accuracy_items = items[args.shots + args.prompts:args.shots + args.prompts + args.accuracy_items]

        def accuracy(fmt: KVFormat, sink: int, tail: int) -> float | None:
            if not task_mode:
                return None
            correct = 0
            for item in accuracy_items:
                ids = tokenizer.encode(prefix + item["prompt"])
                tokens, _ = greedy(decoder, ids, 12, new_store(model, fmt, sink, tail), stop)
                correct += tokenizer.decode(tokens).strip().split("\n")[0].strip() == item["answer"]
            return correct / len(accuracy_items)

        model_dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
        rows = [{"kv_cache_dtype": f"auto ({model_dtype}, reference)", "sink": 0, "tail": 0,
                 "accuracy": accuracy(dense, 0, 0)}]
        print(rows[-1], flush=True)
        for name in args.formats:
            fmt = parse_kv_cache_dtype(name)
            for sink, tail in side_pools if fmt.kind == "kvarn" else [(0, 0)]:
                measured = [teacher_forced(decoder, p, t, new_store(model, fmt, sink, tail))
                            for p, t in zip(prompts, ref_tokens)]
                row = {"kv_cache_dtype": name, "sink": sink, "tail": tail,
                       **kl_rows(ref_logprobs, ref_tokens, measured), "accuracy": accuracy(fmt, sink, tail)}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "kl_by_position"}, flush=True)
                if args.out:  # after every row, so a run cut short keeps its numbers
                    partial = {**results, "outputs": rows}
                    write_results(args.out, partial, markdown(partial))
    results["outputs"] = rows
    if args.out:
        write_results(args.out, results, markdown(results))
    print(markdown(results))


def accuracy_cell(row: dict) -> str:
    return "-" if row["accuracy"] is None else f"{row['accuracy']:.3f}"


def markdown(results: dict) -> str:
    lines = [f"Low-bit KV formats, {results['device']}, torch {results['torch']}, "
             f"commit {results['commit']}.", "",
             "Capacity: 4096-token sequences (512 prompt + 3584 generated) in a 64 GiB pool at Ouro-1.4B's "
             "shape (96 slots, 16 kv heads, head_dim 128), byte accounting:", "",
             "| kv_cache_dtype | kv_sharing | sink | tail | side pool | MiB / sequence | sequences "
             "| x bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["capacity"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['kv_sharing']} | {r['sink']} | {r['tail']} | "
                     f"{r['side_pool']} | "
                     f"{r['mib_per_sequence']} | {r['sequences']} | {r['x_bf16']} |")
    if "outputs" in results:
        buckets = [key for key in results["outputs"][1]["kl_by_position"]]
        sizes = results["prompt_tokens"]
        shots = f"{results['shots']}-shot addition" if results.get("shots") else "random tokens"
        model = results.get("model", "The embedded tiny trained model (fp32)")
        lines += ["", f"{model}, {len(sizes)} prompts of {min(sizes)}-{max(sizes)} tokens ({shots}), "
                  f"{results['new_tokens']} "
                  "teacher-forced greedy tokens each; KL(reference || format) per generated position, mean / "
                  "p99 per position bucket; agreement: tokens before the first greedy divergence (mean over "
                  "prompts); accuracy: the addition task, free-running greedy:", "",
                  "| kv_cache_dtype | sink | tail | KL mean | " + " | ".join(buckets)
                  + " | agreement | accuracy |",
                  "|---|---|---|---|" + "---|" * len(buckets) + "---|---|"]
        for r in results["outputs"]:
            if "kl_mean" not in r:
                lines.append(f"| {r['kv_cache_dtype']} | - | - | 0 | " + " | ".join("0" for _ in buckets)
                             + f" | all | {accuracy_cell(r)} |")
                continue
            cells = [f"{r['kl_by_position'][b]['mean']:.2e} / {r['kl_by_position'][b]['p99']:.2e}"
                     if b in r["kl_by_position"] else "-" for b in buckets]
            lines.append(f"| {r['kv_cache_dtype']} | {r['sink']} | {r['tail']} | {r['kl_mean']:.2e} | "
                         + " | ".join(cells) + f" | {r['agreement_mean']:.0f} | {accuracy_cell(r)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
