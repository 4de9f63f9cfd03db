"""Decode-time KV sharing: how many 4K-token sequences fit in a fixed KV memory budget with
kv_sharing="last" against "none". Pure accounting, so it runs on CPU as well as GPU.

    python -m benchmarks.kv_sharing --out benchmarks/results/kv_sharing.json [--budget-gib 64]

The budget becomes blocks exactly as the Engine sizes its pool (KVPool.blocks_for_budget), and the count is
checked by admitting sequences into the engine's own block manager, under each KV layout (cache/layout.py),
until the next one no longer fits. Prompt tokens keep T x L planes; generated tokens keep L under "last".
arXiv 2510.25741 §5.4.2 (Ouro-1.4B): last-loop sharing GSM8K 78.85 vs 78.92 full, MATH-500 80.40 vs 82.40.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import environment, write_results
from cache.blocks import BlockManager
from cache.kv_pool import KVPool, slot_token_bytes
from cache.layout import make_layout
from model.config import OuroConfig
from model.looped import SlotMap
from model.tiny import PRESETS, hf_config
from request import Request, SamplingParams

SEQUENCE = 4096
PAPER = "arXiv 2510.25741 §5.4.2: GSM8K 78.85 (last) vs 78.92 (full), MATH-500 80.40 vs 82.40"


def admitted(manager: BlockManager, prompt: int, generated: int) -> int:
    """Sequences of prompt + generated tokens the manager holds at once, by allocating them."""
    count = 0
    while True:
        request = Request(str(count), [1] * prompt, SamplingParams())
        if not manager.can_append(request, prompt):
            return count
        manager.append_slots(request, prompt)
        request.num_computed_tokens = prompt
        request.token_ids += [1] * generated
        if not manager.can_append(request, generated):
            return count
        manager.append_slots(request, generated)
        count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["ouro-1.4b", "ouro-2.6b"])
    parser.add_argument("--budget-gib", type=float, default=64.0, help="KV memory budget")
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4095],
                        help="prompt tokens of each 4096-token sequence; the rest is generated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=f"benchmarks/results/kv_sharing-{environment()['date']}.json")
    args = parser.parse_args()
    dtype, budget = torch.bfloat16, args.budget_gib * 2**30
    rows = []
    for preset in args.presets:
        config = OuroConfig.from_dict(hf_config(PRESETS[preset]))
        loops, layers = config.total_ut_steps, config.num_hidden_layers
        slot_bytes = slot_token_bytes(config.num_key_value_heads, config.head_dim, dtype)
        blocks = KVPool.blocks_for_budget(loops * layers * args.block_size * slot_bytes, budget)
        layouts = {s: make_layout(name, SlotMap(loops, layers), args.block_size)
                   for s, name in (("none", "full"), ("last", "shared-last"))}
        for prompt in args.prompts:
            generated = SEQUENCE - prompt
            counts = {}
            for sharing, layout in layouts.items():
                manager = BlockManager(blocks, args.block_size, False, layout=layout)
                counts[sharing] = admitted(manager, prompt, generated)
                assert counts[sharing] == layout.max_concurrent_sequences(blocks, prompt, generated)
            per_sequence = {s: prompt * layout.token_bytes(slot_bytes, False)
                            + generated * layout.token_bytes(slot_bytes, True)
                            for s, layout in layouts.items()}
            rows.append({"model": preset, "blocks": blocks, "prompt": prompt, "generated": generated,
                         "bytes_per_prompt_token": layouts["last"].token_bytes(slot_bytes, False),
                         "bytes_per_generated_token_none": layouts["none"].token_bytes(slot_bytes, True),
                         "bytes_per_generated_token_last": layouts["last"].token_bytes(slot_bytes, True),
                         "gib_per_sequence_none": round(per_sequence["none"] / 2**30, 3),
                         "gib_per_sequence_last": round(per_sequence["last"] / 2**30, 3),
                         "max_sequences_none": counts["none"], "max_sequences_last": counts["last"],
                         "ratio": round(counts["last"] / max(counts["none"], 1), 2)})
            print(rows[-1], flush=True)
    env = environment()
    lines = [f"Max concurrent {SEQUENCE}-token sequences in {args.budget_gib:g} GiB of bf16 KV, blocks of "
             f"{args.block_size} ({env['device']}, torch {env['torch']}, commit {env['commit']}); "
             f"{PAPER}.", "",
             "| model | prompt + generated | KiB/token prompt | KiB/generated token none / last "
             "| GiB/seq none / last | max seqs none | max seqs last | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kib = [r[k] // 1024 for k in ("bytes_per_prompt_token", "bytes_per_generated_token_none",
                                      "bytes_per_generated_token_last")]
        lines.append(f"| {r['model']} | {r['prompt']} + {r['generated']} | {kib[0]} | {kib[1]} / {kib[2]} | "
                     f"{r['gib_per_sequence_none']} / {r['gib_per_sequence_last']} | "
                     f"{r['max_sequences_none']} | {r['max_sequences_last']} | {r['ratio']} |")
    table = "\n".join(lines)
    write_results(args.out, {**env, "budget_gib": args.budget_gib, "dtype": "bfloat16",
                             "block_size": args.block_size, "sequence_tokens": SEQUENCE, "paper": PAPER,
                             "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
