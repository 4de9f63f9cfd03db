"""The step between two chained passes of pipelined self-speculation as one Triton kernel
(runner/speculative_chains.py: SpeculativeChains.fused_step launches it, in the chain graphs): one program
per request, over its M rows. It does what SpeculativeChains.step's tensor operations do after the head's
argmax (about a hundred launches of a few elements each, which in a CUDA graph still cost a couple of
microseconds apiece): verify the finished token, drop, draft or restart, write the record, move every row to
its next loop, and write the next pass's inputs in place (states, positions, slots, lengths, slot offsets).
Integers and copies only: the bits are those of the tensor operations, which the CPU suite checks in the
interpreter (tests/test_pipelined_step_kernel.py)."""

import triton
import triton.language as tl


@triton.jit
def pipelined_step_kernel(
        active_ptr, position_ptr, loop_ptr, given_ptr, token_ptr,  # [n] each: the rows, in place
        first_ptr, end_ptr, table_ptr, table_stride, columns, scratch,  # the reservations
        force_ptr, count_ptr, record_ptr, record_pass_stride, record_field_stride, served_ptr,
        slot_ptr, lengths_ptr, offsets_ptr, offset_of_ptr,  # the next pass's inputs
        output_ptr, embedded_ptr, state_ptr, hidden_ptr, gate_ptr, gates_ptr,  # the rows' vectors
        M: tl.constexpr, BLOCK_M: tl.constexpr, LOOPS: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    s = tl.arange(0, BLOCK_M)
    inside = s < M
    row = r * M + s
    active = (tl.load(active_ptr + row, mask=inside, other=0) != 0) & inside
    position = tl.load(position_ptr + row, mask=inside, other=0)
    loop = tl.load(loop_ptr + row, mask=inside, other=0)
    given = tl.load(given_ptr + row, mask=inside, other=0)
    argmax = tl.load(token_ptr + row, mask=inside, other=0)
    end = tl.load(end_ptr + r)
    force = tl.load(force_ptr)
    count = tl.load(count_ptr)

    # the first token in flight finishes at loop T-1; the token behind it confirms it (or not)
    finished = active & (loop == LOOPS - 1)
    ended = tl.max(finished.to(tl.int32), 0) > 0
    head = tl.min(tl.where(finished, s, BLOCK_M), 0)
    head = tl.where(ended, head, 0)
    at_head = s == head
    head_position = tl.sum(tl.where(at_head, position, 0), 0)
    emitted = tl.sum(tl.where(at_head, argmax, 0), 0)
    behind = active & (position == head_position + 1)
    draft = tl.sum(tl.where(behind, given, 0), 0)
    confirms = tl.where(force < 0, draft == emitted, force > 0)
    accepted = ended & (tl.max(behind.to(tl.int32), 0) > 0) & confirms
    emitted = tl.where(accepted, draft, emitted)
    dropped = ended & ~accepted & active & (position > head_position)
    alive = active & ~finished & ~dropped

    # a draft from the last token in flight at loop d-1, or the finished token restarting the next position
    last = tl.max(tl.where(alive, position, -1), 0)
    drafting = alive & (loop == D - 1) & (position == last) & (last + 1 < end)
    any_draft = tl.max(drafting.to(tl.int32), 0) > 0
    restart = ended & ~accepted & (head_position + 1 < end)
    starts = restart | any_draft
    start_position = tl.where(restart, head_position, last) + 1
    source = tl.where(restart, head, tl.min(tl.where(drafting, s, BLOCK_M), 0))  # whose argmax starts
    start_token = tl.where(restart, emitted, tl.sum(tl.where(drafting, argmax, 0), 0))
    free = tl.min(tl.where(~alive & inside, s, BLOCK_M), 0)
    free = tl.where(free == BLOCK_M, 0, free)
    seat = starts & (s == free)

    record = record_ptr + count * record_pass_stride + r
    tl.store(record, ended.to(tl.int64))
    tl.store(record + record_field_stride, emitted.to(tl.int64))
    tl.store(record + 2 * record_field_stride, head.to(tl.int64))
    tl.store(record + 3 * record_field_stride, accepted.to(tl.int64))
    tl.store(record + 4 * record_field_stride, tl.sum(dropped.to(tl.int64), 0))
    tl.store(record + 5 * record_field_stride, starts.to(tl.int64))
    tl.store(record + 6 * record_field_stride, free.to(tl.int64))
    tl.atomic_add(served_ptr + count, tl.sum(active.to(tl.int64), 0))

    next_loop = tl.where(seat, 0, tl.where(alive, loop + 1, 0))
    next_position = tl.where(seat, start_position, position)
    next_active = alive | seat
    first = tl.load(first_ptr + r)
    column = tl.minimum(tl.maximum(next_position - first, 0), columns - 1)
    slot = tl.load(table_ptr + r * table_stride + column, mask=inside, other=0)
    tl.store(loop_ptr + row, next_loop, mask=inside)
    tl.store(position_ptr + row, next_position, mask=inside)
    tl.store(active_ptr + row, next_active.to(tl.int1), mask=inside)
    tl.store(given_ptr + row, tl.where(seat, start_token, given), mask=inside)
    tl.store(slot_ptr + row, tl.where(next_active, slot, scratch), mask=inside)
    tl.store(lengths_ptr + row, (next_position + 1).to(tl.int32), mask=inside)
    tl.store(offsets_ptr + row, tl.load(offset_of_ptr + next_loop, mask=inside, other=0), mask=inside)

    # vectors: the loop's output into its loop's column and the next state; a seated row starts from its
    # token's embedding with its loop outputs zeroed and its gates NaN
    gate = tl.load(gate_ptr + row, mask=inside, other=0)
    for t in tl.static_range(LOOPS):
        tl.store(gates_ptr + row * LOOPS + t, tl.where(seat, float("nan"), gate).to(gate.dtype),
                 mask=inside & (seat | (loop == t)))
    h_offsets = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + h_offsets
        in_h = cols < H
        both = inside[:, None] & in_h[None, :]
        out = tl.load(output_ptr + row[:, None] * H + cols[None, :], mask=both, other=0)
        embedded = tl.load(embedded_ptr + (r * M + source) * H + cols, mask=in_h, other=0)
        state = tl.where(seat[:, None], embedded[None, :], out)
        tl.store(state_ptr + row[:, None] * H + cols[None, :], state, mask=both)
        kept = tl.where(seat[:, None], tl.zeros_like(out), out)
        for t in tl.static_range(LOOPS):
            tl.store(hidden_ptr + (row[:, None] * LOOPS + t) * H + cols[None, :], kept,
                     mask=both & (seat | (loop == t))[:, None])
