"""The Triton runtime every package's kernels stand on: how a kernel launches (launch.py), Programmatic
Dependent Launch (pdl.py, pdl_launch.py), the current stream (stream.py), the eager attention workspace
(workspace.py), and the jit helpers kernels of more than one package share (rounding.py, kvarn_record.py).

It imports nothing of the engine, only torch and triton; this file imports nothing at all, so that
installed.py answers whether Triton is there without needing it.
"""
