"""The eager decode workspace: per (device, stream), one fp32 buffer of split partial state and the
int32 split tickets. Graph-captured decode never uses it; its buffers belong to the backend instance. The
stream is triton_runtime/stream.py's raw handle.

A hit is one dict lookup. Growth and eviction (oldest entry first, at most 16) happen only on a miss.
Tickets are zeroed once, at allocation; the decode kernel puts each back to 0 after its merge, so no
torch op ever writes a cached tensor (such an op would fail on an inference tensor outside
`torch.inference_mode`).
"""

from __future__ import annotations

import dataclasses

import torch

MAX_ENTRIES = 16


@dataclasses.dataclass(slots=True)
class WorkspaceEntry:
    partials: torch.Tensor  # fp32: split maxima, sums and accumulators
    tickets: torch.Tensor  # int32, one per (row, head); 0 between launches


class Workspace:
    """Grow-only buffers keyed by (device index, raw stream handle); insertion order is age."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[int, int], WorkspaceEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def oldest_first(self) -> list[tuple[int, int]]:
        return list(self._entries)

    def get(self, device: torch.device, stream: int, partials: int, tickets: int) -> WorkspaceEntry:
        """An entry with at least `partials` fp32 and `tickets` int32 elements for (device, stream)."""
        key = (-1 if device.index is None else device.index, stream)
        entry = self._entries.get(key)
        if entry is not None and entry.partials.numel() >= partials and entry.tickets.numel() >= tickets:
            return entry
        return self._miss(key, entry, device, partials, tickets)

    def _miss(self, key: tuple[int, int], entry: WorkspaceEntry | None, device: torch.device,
              partials: int, tickets: int) -> WorkspaceEntry:
        if entry is None:
            while len(self._entries) >= self.max_entries:
                del self._entries[next(iter(self._entries))]
            entry = WorkspaceEntry(torch.empty(partials, dtype=torch.float32, device=device),
                                   torch.zeros(tickets, dtype=torch.int32, device=device))
        else:  # grow in place of the old entry, keeping its age
            if entry.partials.numel() < partials:
                grown = torch.empty(partials, dtype=torch.float32, device=device)
                entry = WorkspaceEntry(grown, entry.tickets)
            if entry.tickets.numel() < tickets:
                entry = WorkspaceEntry(entry.partials, torch.zeros(tickets, dtype=torch.int32, device=device))
        self._entries[key] = entry
        return entry
