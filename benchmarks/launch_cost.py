"""Host µs of one Triton launch, by how it reaches the driver: a trivial kernel with P pointer arguments (and
the same integer and constexpr tail each time), launched in a hot loop without syncs,
- jit: through Triton's JIT (`kernel[grid](...)`: binding and specialization at every call);
- tensors: attention.launch.CompiledLaunch as before 2026-12-04, given tensors and calling compiled.run:
  Triton's C launcher then calls each tensor's data_ptr() and asks the driver about the address
  (cuPointerGetAttribute) for every pointer argument, at every launch;
- ints: CompiledLaunch handing the addresses over as ints (Triton's launcher takes an int as the address
  itself), read from the tensors at each call, through compiled.run (eafc711) or straight into Triton's C
  launch function (attention.launch.c_launcher: the engine's launch where it applies);
- ints kept: the same with addresses read once before the loop (what a plan holding a fixed tensor's address
  would pass).
A torch.add of two small tensors is timed beside them: the host's own speed.

    python -m benchmarks.launch_cost [--pointers 2 8 16] [--calls 4000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import linecache
import tempfile

import torch

from attention.launch import CompiledLaunch
from benchmarks.common import environment, host_us, write_results


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
    launches = {name: CompiledLaunch(kernel, (1, 1, 1), 4, 1) for name in ("tensors", "run", "c", "kept_c")}
    for each in launches.values():
        each(stream, tuple(tensors) + tail)  # compiles; later calls launch directly
    launches["tensors"].pointers = launches["kept_c"].pointers = ()  # given tensors, or ints as they are
    launches["tensors"].c_launch = launches["run"].c_launch = None  # through compiled.run
    tensors_run, ints_run, ints_c, kept_c = (launches[name] for name in ("tensors", "run", "c", "kept_c"))
    a, b = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    return {
        "pointers": pointers,
        "c_launcher_applies": ints_c.c_launch is not None,
        "jit_us": host_us(lambda i: kernel[(1,)](*tensors, 256, BLOCK=256), calls),
        "tensors_us": host_us(lambda i: tensors_run(stream, tuple(tensors) + tail), calls),
        "ints_run_us": host_us(lambda i: ints_run(stream, tuple(tensors) + tail), calls),
        "ints_c_us": host_us(lambda i: ints_c(stream, tuple(tensors) + tail), calls),
        "ints_kept_run_us": host_us(lambda i: tensors_run(stream, tuple(addresses) + tail), calls),
        "ints_kept_c_us": host_us(lambda i: kept_c(stream, tuple(addresses) + tail), calls),
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
    keys = ("jit_us", "tensors_us", "ints_run_us", "ints_c_us", "ints_kept_run_us", "ints_kept_c_us",
            "torch_add_us")
    header = ("| pointer args | Triton JIT | tensors, compiled.run | ints, compiled.run | ints, C launch "
              "| ints kept, compiled.run | ints kept, C launch | torch.add |\n|" + "---|" * 8 + "\n")
    table = header + "".join(f"| {r['pointers']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |\n"
                             for r in rows)
    env = environment()
    print(table)
    if args.out:
        write_results(args.out, {"environment": env, "calls": args.calls, "rows": rows},
                      f"Host µs a launch by how it reaches the driver, {args.calls} launches a figure; "
                      f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}"
                      ".\n\n" + table)


if __name__ == "__main__":
    main()
