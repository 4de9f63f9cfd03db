"""The step between two chained loop passes as one Triton kernel, in the chain graphs
(runner/chain_graphs.py): `chain_step_kernel` for plain chains (PassChains.fused_step), one program per
block of rows, and `pipelined_step_kernel` for pipelined self-speculation (SpeculativeChains.fused_step), one
program per request, over its M rows. Each does what the step's tensor operations do after the exit rule and
the head's argmax (tens of launches of a few elements each, which in a CUDA graph still cost a couple of
microseconds apiece): the record, every row's next loop, position and slot, a finished row's next token
(its embedding, its loop outputs zeroed and gates NaN), and the next pass's inputs in place (states,
lengths, slot offsets). Integers and copies only: the bits are those of the tensor operations, which the CPU
suite checks pass by pass in the interpreter (tests/test_pass_chains.py, tests/test_pipelined_speculation.py).
"""

import triton
import triton.language as tl


@triton.jit
def start_rows(row, inside, seat, loop, embedded_offset, output_ptr, embedded_ptr, state_ptr, hidden_ptr,
               gate_ptr, gates_ptr, LOOPS: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """The loop's output (output, [n, H]) and gate logit (gate, [n]) into each row's column `loop` of hidden
    [n, LOOPS, H] and gates [n, LOOPS], and into its next state (state [n, H]); a row that starts a token
    (seat) instead gets the embedding at its embedded_offset (one a row) as its state, its loop outputs zeroed
    and its gates NaN."""
    gate = tl.load(gate_ptr + row, mask=inside, other=0)
    for t in tl.static_range(LOOPS):
        tl.store(gates_ptr + row * LOOPS + t, tl.where(seat, float("nan"), gate).to(gate.dtype),
                 mask=inside & (seat | (loop == t)))
    h_offsets = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + h_offsets
        both = inside[:, None] & (cols < H)[None, :]
        out = tl.load(output_ptr + row[:, None] * H + cols[None, :], mask=both, other=0)
        embedded = tl.load(embedded_ptr + embedded_offset[:, None] + cols[None, :], mask=both, other=0)
        tl.store(state_ptr + row[:, None] * H + cols[None, :], tl.where(seat[:, None], embedded, out),
                 mask=both)
        kept = tl.where(seat[:, None], tl.zeros_like(out), out)
        for t in tl.static_range(LOOPS):
            tl.store(hidden_ptr + (row[:, None] * LOOPS + t) * H + cols[None, :], kept,
                     mask=both & (seat | (loop == t))[:, None])


@triton.jit
def chain_step_kernel(
        active_ptr, loop_ptr, finished_ptr, position_ptr, done_ptr, token_ptr, n,  # [n] each: the rows
        first_ptr, reserved_ptr, table_ptr, table_stride, columns,  # what the steps read
        count_ptr, record_ptr, record_pass_stride, record_field_stride,
        slot_ptr, lengths_ptr, offsets_ptr, offset_of_ptr,  # the next pass's inputs
        output_ptr, embedded_ptr, state_ptr, hidden_ptr, gate_ptr, gates_ptr,  # the rows' vectors
        BLOCK_R: tl.constexpr, LOOPS: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = row < n
    active = tl.load(active_ptr + row, mask=inside, other=0) != 0
    loop = tl.load(loop_ptr + row, mask=inside, other=0)
    done = (tl.load(done_ptr + row, mask=inside, other=0) != 0) & inside
    token = tl.load(token_ptr + row, mask=inside, other=0)
    count = tl.load(count_ptr)
    record = record_ptr + count * record_pass_stride + row
    tl.store(record, active.to(tl.int64), mask=inside)
    tl.store(record + record_field_stride, done.to(tl.int64), mask=inside)
    tl.store(record + 2 * record_field_stride, token, mask=inside)
    tl.store(record + 3 * record_field_stride, loop, mask=inside)

    # a finished token's row starts the next token at loop 0, one position on (or idles, its reservation
    # used); the others go on to their next loop
    reserved = tl.load(reserved_ptr + row, mask=inside, other=0)
    finished = tl.load(finished_ptr + row, mask=inside, other=0) + done.to(tl.int64)
    next_active = finished < reserved
    next_loop = tl.where(done | ~next_active, 0, loop + 1)
    position = tl.load(first_ptr + row, mask=inside, other=0) + tl.maximum(tl.minimum(finished, reserved - 1),
                                                                          0)
    tl.store(finished_ptr + row, finished, mask=inside)
    tl.store(active_ptr + row, next_active.to(tl.int1), mask=inside)
    tl.store(loop_ptr + row, next_loop, mask=inside)
    tl.store(position_ptr + row, position, mask=inside)
    column = tl.minimum(finished, columns - 1)
    slot = tl.load(table_ptr + row * table_stride + column, mask=inside, other=0)
    tl.store(slot_ptr + row, slot, mask=inside)
    tl.store(lengths_ptr + row, (position + 1).to(tl.int32), mask=inside)
    tl.store(offsets_ptr + row, tl.load(offset_of_ptr + next_loop, mask=inside, other=0), mask=inside)
    start_rows(row, inside, done, loop, row * H, output_ptr, embedded_ptr, state_ptr, hidden_ptr, gate_ptr,
               gates_ptr, LOOPS, H, BLOCK_H)


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

    start_rows(row, inside, seat, loop, (r * M + source) * H + 0 * row, output_ptr, embedded_ptr, state_ptr,
               hidden_ptr, gate_ptr, gates_ptr, LOOPS, H, BLOCK_H)
