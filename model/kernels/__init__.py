"""Triton kernels for the model's elementwise work around the projections: RMSNorm with the residual add,
SiLU-mul and RoPE (with an optional KV store). Attention kernels live in attention/kernels."""
