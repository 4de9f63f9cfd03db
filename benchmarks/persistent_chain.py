"""Is a grid barrier inside one persistent kernel cheaper than a kernel boundary? The question a persistent
batch-1 layer kernel (issue 11's last 0.3x) hangs on, asked of the projections alone.

A token at batch 1 runs Ouro-1.4B's four projections (qkv, o, gate_up, down) in each of 96 layer applications
(24 layers x 4 loops): a chain of 384 matrix-vector products, each reading the vector the previous one wrote,
over 9.9 GB of weights (each layer's 103 MB, more than the 60 MB L2, so nothing stays cached between loops).
The chain runs here three ways, each one CUDA graph replayed:
- per-phase: the chain kernel below launched once a product (384 launches, PDL on where supported: a program
  asks L2 for its first weight tile, then waits for the previous kernel);
- persistent: the same kernel launched once, its programs (a fixed number a SM, all resident) crossing a grid
  barrier between products (an atomic counter each program adds to, then spins on); between its arrival and
  its wait a program asks L2 for its first tile of the next product;
- engine: model/kernels/gemv.py's skinny GEMM, as the engine calls it at one row (split-K, tuned configs).
The per-phase and persistent runs compute the same tiles in the same order, so their outputs must agree bit
for bit (a barrier that let a program read a stale vector would break that); both are checked against torch.
The same two runs over products of no rows time the bare boundaries: a launch and a barrier a product.

    python -m benchmarks.persistent_chain --out benchmarks/results/persistent_chain.json

Prints ms a token, GB/s and the fraction of the device-to-device copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

import benchmarks.common as common
from attention.pdl import launch_dependents, pdl_supported, wait_for_previous
from model.kernels.gemv import prefetch_l2, skinny_linear

# (name, N, K) of Ouro-1.4B's projections at bf16, in the order a layer runs them
SHAPES = (("qkv", 6144, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632))
LAYERS, LOOPS = 24, 4
# A barrier that waits longer gives up and flags the run (its programs were not all resident).
MAX_SPINS = tl.constexpr(1 << 22)


@triton.jit
def _product(table_ptr, phase, BLOCK_K: tl.constexpr):
    """Product `phase`'s weight offset, N and K from the table. The hints (check_shapes holds them) let the
    compiler vectorize and pipeline the weight loads."""
    w_off = tl.multiple_of(tl.load(table_ptr + 3 * phase), 16)
    n = tl.load(table_ptr + 3 * phase + 1).to(tl.int32)
    k = tl.multiple_of(tl.load(table_ptr + 3 * phase + 2).to(tl.int32), BLOCK_K)
    return w_off, n, k


@triton.jit
def _prefetch_tile(w_ptr, table_ptr, phase, pid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PREFETCH_K: tl.constexpr):
    """Asks L2 for this program's first tile of `phase`: BLOCK_N rows, the first PREFETCH_K columns."""
    w_off, n, k = _product(table_ptr, phase, BLOCK_K)
    if pid * BLOCK_N < n:
        LINE: tl.constexpr = 64  # bf16 elements in a 128-byte line
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(tl.arange(0, PREFETCH_K // LINE) * LINE, k - 1)
        prefetch_l2(w_ptr + w_off + rows.to(tl.int64)[:, None] * k + cols[None, :])


@triton.jit
def chain_kernel(table_ptr, w_ptr, act_ptr, counter_ptr, flag_ptr, first_phase, phases, act_stride,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    """Products first_phase .. first_phase + phases - 1 of the chain. Product p: y = W_p x, W_p the [n, k]
    row-major matrix at w_ptr + table[3p] (n = table[3p + 1], k = table[3p + 2], multiples of BLOCK_N and
    BLOCK_K), x the first k entries of act row p % 2, y written to act row (p + 1) % 2. Program `pid` takes
    row tiles pid, pid + programs, ..; with phases > 1 every program must be resident, since a grid barrier
    separates the products."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if PREFETCH_K:
        _prefetch_tile(w_ptr, table_ptr, first_phase, pid, BLOCK_N, BLOCK_K, PREFETCH_K)
    wait_for_previous(PDL)
    launch_dependents(PDL)
    for step in range(phases):
        phase = first_phase + step
        w_off, n, k = _product(table_ptr, phase, BLOCK_K)
        x_ptr = act_ptr + (phase % 2) * act_stride
        y_ptr = act_ptr + ((phase + 1) % 2) * act_stride
        for tile in range(pid, n // BLOCK_N, programs):
            rows = tile * BLOCK_N + offs_n
            w_ptrs = w_ptr + w_off + rows.to(tl.int64)[:, None] * k + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for col in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
                w = tl.load(w_ptrs + col, eviction_policy="evict_first")
                # Other programs wrote x in this launch: the barrier's acquire (one thread's, then the
                # block's bar.sync) orders these loads after those writes, L1 included.
                x = tl.load(x_ptr + col + offs_k)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))
        if step + 1 < phases:
            # Arrive (every thread's stores are done before one thread releases them), fetch ahead, wait.
            tl.debug_barrier()
            tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
            if PREFETCH_K:
                _prefetch_tile(w_ptr, table_ptr, phase + 1, pid, BLOCK_N, BLOCK_K, PREFETCH_K)
            target = programs * (step + 1)
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins = 0
            while (seen < target) & (spins < MAX_SPINS):
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
                spins += 1
            if seen < target:
                tl.store(flag_ptr, 1)
            tl.debug_barrier()


class Chain:
    """The weights of a chain (one buffer), its table of products, and the two activation rows."""

    def __init__(self, shapes: list[tuple[int, int]], weights: torch.Tensor, offsets: list[int]) -> None:
        device = weights.device
        self.shapes, self.weights, self.offsets = shapes, weights, offsets
        self.table = torch.tensor([v for (n, k), off in zip(shapes, offsets) for v in (off, n, k)],
                                  dtype=torch.int64, device=device)
        self.act_stride = max(max(n, k) for n, k in shapes)
        self.act = torch.zeros(2, self.act_stride, dtype=weights.dtype, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    @classmethod
    def ouro(cls, device: torch.device, layers: int = LAYERS, loops: int = LOOPS) -> Chain:
        """Ouro-1.4B's projections of `loops` passes over `layers` layers, random bf16 weights scaled by
        1/sqrt(K) (a vector keeps its size along the chain)."""
        layer_numel = sum(n * k for _, n, k in SHAPES)
        weights = torch.randn(layers * layer_numel, dtype=torch.bfloat16, device=device)
        shapes, offsets = [], []
        for layer in range(layers):
            start = layer * layer_numel
            for _, n, k in SHAPES:
                weights[start:start + n * k].mul_(k ** -0.5)
                start += n * k
        for _ in range(loops):
            for layer in range(layers):
                start = layer * layer_numel
                for _, n, k in SHAPES:
                    shapes.append((n, k))
                    offsets.append(start)
                    start += n * k
        return cls(shapes, weights, offsets)

    @property
    def phases(self) -> int:
        return len(self.shapes)

    def matrix(self, phase: int) -> torch.Tensor:
        (n, k), off = self.shapes[phase], self.offsets[phase]
        return self.weights[off:off + n * k].view(n, k)

    def bytes(self) -> int:
        return sum(n * k for n, k in self.shapes) * self.weights.element_size()

    def start(self, x: torch.Tensor) -> None:
        self.act.zero_()
        self.act[0, :x.numel()].copy_(x)

    def output(self) -> torch.Tensor:
        n = self.shapes[-1][0]
        return self.act[self.phases % 2, :n].clone()


def check_shapes(chain: Chain, block_n: int, block_k: int) -> None:
    """Raises ValueError naming the first product the chain kernel's tiles and hints do not fit."""
    for phase, (n, k) in enumerate(chain.shapes):
        if n % block_n or k % block_k or k < block_k or chain.offsets[phase] % 16:
            raise ValueError(f"product {phase} is {n} x {k}: N must be a multiple of block_n={block_n} and K "
                             f"a positive multiple of block_k={block_k}, its offset a multiple of 16")


def launch_persistent(chain: Chain, programs: int, block_n: int, block_k: int, stages: int, prefetch_k: int,
                      num_warps: int = 4) -> None:
    """The whole chain in one launch of `programs` programs (all must be resident)."""
    chain.counter.zero_()
    chain_kernel[(programs,)](chain.table, chain.weights, chain.act, chain.counter, chain.flag, 0,
                              chain.phases, chain.act_stride, BLOCK_N=block_n, BLOCK_K=block_k,
                              NUM_STAGES=stages, PREFETCH_K=prefetch_k, PDL=False, num_warps=num_warps)


def launch_per_phase(chain: Chain, programs: int, block_n: int, block_k: int, stages: int, prefetch_k: int,
                     pdl: bool, num_warps: int = 4) -> None:
    """The chain as one launch a product."""
    options = {"launch_pdl": True} if pdl else {}
    for phase in range(chain.phases):
        chain_kernel[(programs,)](chain.table, chain.weights, chain.act, chain.counter, chain.flag, phase, 1,
                                  chain.act_stride, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                                  PREFETCH_K=prefetch_k, PDL=pdl, num_warps=num_warps, **options)


def launch_engine(chain: Chain) -> None:
    """The chain through the engine's skinny GEMM at one row."""
    for phase, (n, k) in enumerate(chain.shapes):
        x = chain.act[phase % 2, :k].view(1, k)
        skinny_linear(x, chain.matrix(phase), out=chain.act[(phase + 1) % 2, :n].view(1, n))


def torch_chain(chain: Chain, x: torch.Tensor, phases: int) -> torch.Tensor:
    """The first `phases` products in fp32 with each vector rounded to the chain's dtype, as the kernel
    stores it."""
    for phase in range(phases):
        n, k = chain.shapes[phase]
        x = (chain.matrix(phase).float() @ x[:k].float()).to(chain.weights.dtype)
    return x


def graph_ms(run) -> float:
    """ms a replay of a CUDA graph of run() (warmed up once eagerly), the median of 10."""
    return common.graph_time_us([run], replays=10, median=True) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-n", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="programs a SM")
    parser.add_argument("--prefetch-k", type=int, default=1024, help="columns of the first tile asked of L2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pdl = pdl_supported(device)
    copy = common.copy_bandwidth()
    chain = Chain.ouro(device)
    empty = Chain([(0, k) for _, k in chain.shapes], chain.weights, chain.offsets)  # the bare boundaries
    x = torch.randn(SHAPES[0][2], dtype=torch.bfloat16, device=device)
    gb = chain.bytes() / 1e9
    result = {**common.environment(), "copy_gbps": round(copy / 1e9), "weights_gb": round(gb, 3),
              "products": chain.phases, "pdl": pdl, "sms": sms, "block_k": args.block_k,
              "stages": args.stages, "prefetch_k": args.prefetch_k, "rows": []}

    def row(name: str, ms: float, **extra) -> None:
        entry = {"run": name, "ms_per_token": round(ms, 4), "gbps": round(gb / ms * 1e3, 1),
                 "of_copy": round(gb / ms * 1e12 / copy, 3), **extra}
        result["rows"].append(entry)
        print(entry)

    row("engine skinny GEMM", graph_ms(lambda: launch_engine(chain)))
    chain.start(x)  # the replays above went on along the chain: its output is one pass's, from x
    launch_engine(chain)
    engine_out = chain.output()
    chain.start(x)
    reference = torch_chain(chain, x, 8)
    for block_n in args.block_n:
        check_shapes(chain, block_n, args.block_k)
        for per_sm in args.per_sm:
            programs = sms * per_sm
            tunables = dict(programs=programs, block_n=block_n, block_k=args.block_k, stages=args.stages,
                            prefetch_k=args.prefetch_k)
            # correctness: 8 products against torch, then the whole chain per-phase against persistent
            short = Chain(chain.shapes[:8], chain.weights, chain.offsets[:8])
            short.start(x)
            launch_persistent(short, **tunables)
            error = ((short.output().float() - reference.float()).norm() / reference.float().norm()).item()
            chain.start(x)
            per_phase_ms = graph_ms(lambda: launch_per_phase(chain, pdl=pdl, **tunables))
            chain.start(x)
            launch_per_phase(chain, pdl=pdl, **tunables)
            per_phase_out = chain.output()
            chain.start(x)
            chain.flag.zero_()
            persistent_ms = graph_ms(lambda: launch_persistent(chain, **tunables))
            chain.start(x)
            launch_persistent(chain, **tunables)
            same = bool(torch.equal(chain.output(), per_phase_out)) and chain.flag.item() == 0
            engine_error = (engine_out.float() - per_phase_out.float()).norm() / per_phase_out.float().norm()
            label = f"block_n {block_n}, {per_sm} a SM"
            row(f"per-phase ({label})", per_phase_ms, **tunables, pdl=pdl)
            row(f"persistent ({label})", persistent_ms, **tunables, error_8_products=round(error, 5),
                same_bits_as_per_phase=same, engine_vs_per_phase_rel=round(engine_error.item(), 4))
            launch_us = graph_ms(lambda: launch_per_phase(empty, pdl=pdl, **tunables)) * 1e3 / empty.phases
            barrier_us = graph_ms(lambda: launch_persistent(empty, **tunables)) * 1e3 / (empty.phases - 1)
            result["rows"].append({"run": f"bare boundaries ({label})", "launch_us": round(launch_us, 3),
                                   "barrier_us": round(barrier_us, 3)})
            print(result["rows"][-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
