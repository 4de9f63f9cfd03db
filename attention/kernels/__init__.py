"""Triton kernels for the paged KV pool: `@triton.jit` functions only. Launch code lives in
attention/triton_backend.py."""
