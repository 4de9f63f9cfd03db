"""Attention backends, one file each, chosen per Engine instance through `attention.registry.select`.

This package reads and writes the paged KV pool and computes attention; it never imports the scheduler.
"""

from attention.base import AttentionBackend, AttentionMetadata, Capabilities
from attention.registry import available, select

__all__ = ["AttentionBackend", "AttentionMetadata", "Capabilities", "available", "select"]
