"""Block tables as one persistent CPU tensor, a row per request, synced by appending: between preemptions a
request's table only grows, so each step writes just the entries added since the last one, and the step's
table is one gather of its rows. Host work per step grows with the rows and the blocks they gained, never
with context length (rebuilding [rows x blocks] Python lists every step does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from request import Request


class BlockTables:
    def __init__(self, width: int, table_of: Callable[[Request], list[int]], rows: int = 64) -> None:
        """width: the most entries one request's table can reach; table_of: which of the request's tables
        (block_table, or generated_block_table) this one mirrors."""
        self.width = width
        self.table_of = table_of
        self.table = torch.zeros((rows, width), dtype=torch.int32)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.synced: dict[str, list[int]] = {}  # request_id -> [row, entries synced, preemption count]

    def gather(self, requests: list[Request]) -> torch.Tensor:
        """[len(requests), longest table] int32 (CPU): the requests' tables, in order. Entries past a
        request's own table are stale (attention stops at each row's context length)."""
        rows, width = [], 1
        for request in requests:
            table = self.table_of(request)
            entry = self.synced.get(request.request_id)
            if entry is None:
                entry = self.synced[request.request_id] = [self._take_row(), 0, request.num_preemptions]
            elif entry[2] != request.num_preemptions:  # preempted since: its table was rebuilt
                entry[1:] = [0, request.num_preemptions]
            row, done = entry[0], entry[1]
            if len(table) > done:
                self.table[row, done:len(table)] = torch.tensor(table[done:], dtype=torch.int32)
                entry[1] = len(table)
            rows.append(row)
            width = max(width, len(table))
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):  # usual: rows taken in order
            return self.table[rows[0]:rows[0] + len(rows), :width]
        return self.table[torch.tensor(rows, dtype=torch.int64), :width]

    def release(self, request: Request) -> None:
        entry = self.synced.pop(request.request_id, None)
        if entry is not None:
            self.free_rows.append(entry[0])

    def _take_row(self) -> int:
        if not self.free_rows:  # grow: twice the rows, the old ones kept
            old = self.table
            self.table = torch.zeros((2 * old.shape[0], self.width), dtype=torch.int32)
            self.table[:old.shape[0]] = old
            self.free_rows = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))
        return self.free_rows.pop()
