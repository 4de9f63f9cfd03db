"""What every benchmark records: the environment, a copy bandwidth measured in the same run, a
checkpoint to run (a given one, or a generated real-shape one), and the decode bandwidth floor; and the
decode timing loop they share (random prompts, prefill until every row has its first token, then the timed
steps)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The git commit benchmarked. The device machine gets a copy of the tree without .git, so the
    caller passes the hash as LOOP_ENGINE_COMMIT there (read once, here, at benchmark start). A tree with
    uncommitted changes to tracked files reports its HEAD + "+uncommitted"."""
    if os.environ.get("LOOP_ENGINE_COMMIT"):
        return os.environ["LOOP_ENGINE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip()
        return head + "+uncommitted" if changed and head != "unknown" else head
    except OSError:
        return "unknown"


def environment() -> dict:
    """Device, library versions (triton None where it is not installed: the CPU path runs without it),
    commit and date."""
    try:
        import triton
    except ModuleNotFoundError:
        triton = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton and triton.__version__,
            "commit": commit(), "date": datetime.date.today().isoformat()}


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times)[len(times) // 2]


def matmul_rate(n: int = 8192) -> float:
    """The bf16 matmul rate in FLOP/s: an n x n x n product, timed over ten after three warm-ups."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def checkpoint(model: str | None, preset: str | None, cache_dir: str = "/tmp/loop-engine-bench") -> str:
    if model:
        return model
    from model.tiny import write_checkpoint

    path = Path(cache_dir) / preset
    if not (path / "model.safetensors").exists():
        write_checkpoint(path, preset=preset, seed=0)
    return str(path)


def weight_bytes_per_step(engine) -> int:
    """Bytes a decode step must read: the weights one loop runs, once per loop, plus those a step runs
    once."""
    per_loop, once = loop_and_step_weight_bytes(engine)
    return engine.loops * per_loop + once


def loop_and_step_weight_bytes(engine) -> tuple[int, int]:
    """(the weights one loop runs, those a step runs once) in bytes: Ouro's once are the final norm, the exit
    gate and lm_head; Huginn's the prelude, the coda, ln_f and the head, tied to the embedding. The embedding
    itself counts only as the head, since a step reads its rows' vectors."""
    model = engine.model
    if hasattr(model, "core_blocks"):  # Huginn-0125 (model/huginn.py)
        head = model.wte if model.lm_head is None else model.lm_head
        return (_bytes(model.adapter, model.core_blocks),
                _bytes(model.prelude_blocks, model.coda_blocks, model.ln_f, head))
    return _bytes(model.layers), _bytes(model.lm_head, model.norm, model.early_exit_gate)


def kv_bytes_read_per_token(engine) -> float:
    """KV bytes a full-depth decode step reads per context token of one row: one slot's K and V for each layer
    the step applies (the prelude's, each loop's, the coda's). That is the pool's bytes per token in the full
    layout, where every application has its own slot, and more where a ring (compress:k) keeps fewer slots
    than the step applies layers: each application still reads a whole slot of the context."""
    pool = engine.kv_pool
    slots = pool.slot_map
    applications = slots.prelude_layers + slots.loops * slots.loop_layers + slots.coda_layers
    return pool.slot_token_bytes * applications


def _bytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def add_random_prompts(engine, batch: int, prompt: int, params, rng) -> list[str]:
    """`batch` requests of `prompt` random token ids (3 and up: past the special tokens); their ids."""
    vocab = engine.config.vocab_size
    return [engine.add_request([rng.randrange(3, vocab) for _ in range(prompt)], params)
            for _ in range(batch)]


# max_num_batched_tokens: the engine's default, passed by the benchmarks so that head_start knows it
BATCHED_TOKENS = 8192


def head_start(batch: int, prompt: int, max_num_batched_tokens: int) -> int:
    """A bound on the tokens a row can decode while the batch's other prompts still prefill: one a step,
    and chunked prefill of batch x prompt tokens takes at most this many steps."""
    return -(-batch * prompt // max_num_batched_tokens) + batch + 1


def prefill_until_first_tokens(engine, batch: int) -> int:
    """Step until each of the `batch` newest requests has its first token (its prefill is done). Returns the
    tokens those steps produced beyond each request's first: under async scheduling the step that reads a
    first token runs the next one on at once where it cannot be launched ahead (pipelined speculation's loop
    passes, a chain of which appends several)."""
    produced: dict[str, int] = {}
    while len(produced) < batch:
        produced.update((out.request_id, len(out.outputs[0].token_ids)) for out in engine.step()
                        if out.outputs[0].token_ids)
    return sum(produced.values()) - batch


def time_until_done(engine) -> tuple[float, int]:
    """Step until nothing is left: (wall ms, steps), synchronized with the device on both ends."""
    sync(engine.device)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine.device)
    return (time.perf_counter() - start) * 1e3, steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_results(out: str, payload: dict, table: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=2) + "\n")
    Path(out).with_suffix(".md").write_text(table + "\n")


def graph_time_us(calls: list, replays: int = 10, median: bool = False) -> float:
    """Device µs per call of `calls` (thunks), captured once in one CUDA graph and replayed: the mean
    over all replays, or the median of per-replay times."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if not median:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / (replays * len(calls))
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return sorted(times)[len(times) // 2]


def host_us(fn, calls: int = 2000) -> float:
    """Host µs per eager call of fn(i), in a hot loop without syncs."""
    for i in range(50):
        fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def bare_launch_us(calls: int = 2000) -> float:
    """Host µs of launching a trivial Triton kernel with 4 arguments: the unit host costs are held against."""
    import triton
    import triton.language as tl

    @triton.jit
    def bare_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)
    return host_us(lambda i: bare_kernel[(1,)](x, y, 256, BLOCK=256), calls)
