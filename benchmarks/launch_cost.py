"""Host µs of one Triton launch, by how its pointers are passed: a trivial kernel with P pointer arguments
(and the same integer and constexpr tail each time), launched in a hot loop without syncs,
- through Triton's JIT (`kernel[grid](...)`: binding and specialization at every call);
- through triton_runtime.launch.CompiledLaunch given tensors, as the engine launched until 2026-12-04:
  Triton's C launcher then calls each tensor's data_ptr() and asks the driver about the address
  (cuPointerGetAttribute) for every pointer argument, at every launch;
- through CompiledLaunch as it is now: the addresses as ints (Triton's launcher takes an int as the address
  itself), read from the tensors at each call;
- given ints read once before the loop (what a plan holding a fixed tensor's address would pass).
A torch.add of two small tensors is timed beside them: the host's own speed.

    python -m benchmarks.launch_cost [--pointers 2 8 16] [--calls 4000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import linecache
import tempfile

import torch

from benchmarks.common import environment, host_us, write_results
from triton_runtime.launch import CompiledLaunch


def measure(pointers: int, calls: int) -> dict:
    # triton.jit reads the kernel's source through inspect: the generated function needs a real file.
    names = [f"p{i}" for i in range(pointers)]
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              f"def kernel({', '.join(names)}, n, BLOCK: tl.constexpr):\n"
              "    offs = tl.arange(0, BLOCK)\n"
              "    tl.store(p1 + offs, tl.load(p0 + offs, mask=offs < n), mask=offs < n)\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    scope: dict = {"__file__": handle.name}
    linecache.checkcache(handle.name)
    exec(compile(source, handle.name, "exec"), scope)
    kernel = scope["kernel"]
    tensors = [torch.randn(256, device="cuda") for _ in range(pointers)]
    addresses = [t.data_ptr() for t in tensors]
    tail = (256, 256)
    stream = torch.cuda.current_stream().cuda_stream
    launch, given_tensors = CompiledLaunch(kernel, (1, 1, 1), 4, 1), CompiledLaunch(kernel, (1, 1, 1), 4, 1)
    for each in (launch, given_tensors):
        each(stream, tuple(tensors) + tail)  # compiles; later calls launch directly
    given_tensors.pointers = ()  # hands the tensors to Triton's launcher, as before 2026-12-04
    a, b = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    return {
        "pointers": pointers,
        "jit_us": host_us(lambda i: kernel[(1,)](*tensors, 256, BLOCK=256), calls),
        "tensors_us": host_us(lambda i: given_tensors(stream, tuple(tensors) + tail), calls),
        "ints_read_each_call_us": host_us(lambda i: launch(stream, tuple(tensors) + tail), calls),
        "ints_kept_us": host_us(lambda i: given_tensors(stream, tuple(addresses) + tail), calls),
        "torch_add_us": host_us(lambda i: torch.add(a, b), calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pointers", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [measure(p, args.calls) for p in args.pointers]
    for row in rows:
        print(row)
    header = ("| pointer args | Triton JIT µs | tensors µs | ints read each call µs | ints kept µs "
              "| torch.add µs |\n|---|---|---|---|---|---|\n")
    keys = ("jit_us", "tensors_us", "ints_read_each_call_us", "ints_kept_us", "torch_add_us")
    table = header + "".join(f"| {r['pointers']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |\n"
                             for r in rows)
    env = environment()
    print(table)
    if args.out:
        write_results(args.out, {"environment": env, "calls": args.calls, "rows": rows},
                      f"Host µs a launch by how its pointers are passed, {args.calls} launches a figure; "
                      f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}"
                      ".\n\n" + table)


if __name__ == "__main__":
    main()
