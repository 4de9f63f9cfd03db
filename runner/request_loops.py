"""Per-request loop counts (SamplingParams.loops): the loop driver's hook that stops each row of a request
with k < T loops after its loop k-1, every token of the row (prompt chunk or generated token) at once, and
fills the row's deeper slots as the `latest` KV layout does, so that no plane holds what a loop never wrote.

The stopped rows read out at loop k-1: run_loops repeats a stopped row's last state in the later loops and
runs a model's coda on it (runner/loop_driver.py), and the runner reads out each request's first k loops
(runner/model_runner.py). Exactness: a loop reads only its own slots of the same request's tokens, all of
which ran the same k loops, so the request's tokens are those of an Engine with loops=k.
"""

from __future__ import annotations

import torch

from cache.kv_pool import KVPool
from cache.layout import KVLayout
from runner.loop_driver import LoopExecutor, LoopStats, StepInputs


class RequestLoops:
    """A LoopHook (runner/loop_driver.py) over a batch whose rows run loops[row] loops each, some fewer than
    the engine's. After loop t the live rows with loops[row] == t + 1 < the engine's stop: their tokens' K/V
    of loop t is copied into their deeper slots (cache/copy_forward.py, through the layout) and the executor
    drops them (EagerLoops.keep, or a per-loop graph's compaction). Counts the loops generated tokens run."""

    def __init__(self, loops: list[int], engine_loops: int, layout: KVLayout, pool: KVPool,
                 stats: LoopStats) -> None:
        self.loops = loops
        self.readout_loop = engine_loops - 1  # a row that runs every loop reads out its last
        self.stops = {row: k - 1 for row, k in enumerate(loops) if k < engine_loops}
        self.layout = layout
        self.pool = pool
        self.stats = stats

    def begin(self, inputs: StepInputs, executor: LoopExecutor) -> None:
        self.starts = inputs.meta.query_starts_cpu
        self.slot_mapping = inputs.meta.slot_mapping
        self.stats.decode_loops += sum(self.loops[row] for row in inputs.generated_rows)

    def after_loop(self, t: int, gate_logits: torch.Tensor, live: list[int],
                   reached: torch.Tensor | None, state: torch.Tensor) -> list[int]:
        leaving = [row for row in live if self.stops.get(row) == t]
        if leaving:
            tokens = [i for row in leaving for i in range(self.starts[row], self.starts[row + 1])]
            index = torch.tensor(tokens, dtype=torch.int64).to(self.slot_mapping.device, non_blocking=True)
            self.layout.copy_forward(self.pool, self.slot_mapping[index], t)
        return leaving
