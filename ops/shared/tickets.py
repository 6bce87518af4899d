"""The ordered dQ reduction's ticket protocol: one int32 ticket per (b, hq, Q sub-tile) (for packed
sequences, per (hq, first packed row of the sub-tile)).

A contribution of rank r waits until its ticket reads r, adds its dQ tile with relaxed fp32
atomics, and hands the ticket to rank r+1. The hand-over is deferred by one step: a program
releases step t's ticket only after computing step t+1, so step t's adds have had a whole step of
math to land in L2, and the release costs a CTA barrier plus one fire-and-forget atomic instead of
a round trip for every add. Deferral adds no wait cycle: a program releases everything it holds
before it waits again (docs/kernels-notes.md has the measurements).

Triton's loop scheduler may reorder side-effecting operations that share no data, so every order
the protocol needs is carried by data: the release and the next poll sit in one asm block whose
input comes out of a CTA-wide reduction of the new step's dQ (so every thread's earlier adds are
issued before thread 0's cumulative release), and the adds' addresses carry an opaque zero made from
the value the poll saw. Polls are per-thread acquire loads: no broadcast through shared memory.
Waits are bounded: on timeout a flag is raised, which the launcher turns into an error.
"""

import triton
import triton.language as tl


@triton.jit
def _opaque_zero(x):
    """An int32 zero the compiler cannot see through, computed after ``x``."""
    return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _load_acquire(ticket_ptr, after):
    """This thread's acquire load of a ticket, issued after ``after`` is known."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l,r",
                                     [ticket_ptr, after], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _release_then_poll(held, amount, ticket_ptr, after):
    """Thread 0 adds ``amount`` to ``held`` (release); then every thread acquire-loads ``ticket_ptr``."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred first;
        .reg .u32 tid;
        mov.u32 tid, %tid.x;
        setp.eq.u32 first, tid, 0;
        @first red.release.gpu.global.add.s32 [$1], $2;
        ld.acquire.gpu.global.b32 $0, [$3];
        }""", "=r,l,r,l,r", [held, amount, ticket_ptr, after], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _raise_flag(ERR, after):
    """Set the error flag from this thread (Triton's scalar atomics run on thread 0 only)."""
    tl.inline_asm_elementwise("red.relaxed.gpu.global.max.s32 [$1], 1;\n mov.b32 $0, 0;", "=r,l,r",
                              [ERR, after], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_until(ticket_ptr, rank, seen, ERR, max_spin):
    """Poll (bounded, per thread) until the ticket reads ``rank``; on timeout raise the flag."""
    if seen != rank:
        limit = tl.where(tl.load(ERR, volatile=True) != 0, 0, max_spin)
        spins = 0
        while (seen != rank) & (spins < limit):
            seen = _load_acquire(ticket_ptr, spins)
            spins += 1
        if seen != rank:
            _raise_flag(ERR, seen)
    return seen


@triton.jit
def add_in_turn(acc_ptrs, dq, ticket_ptr, rank, held, held_amount, ERR, max_spin,
                WAITS: tl.constexpr, mask):
    """Release the ticket held from the previous step, wait for ``rank``'s turn, add ``dq``.

    Returns the ticket this program now holds and the amount its release will add. Without WAITS
    (the CPU interpreter runs programs one after another and has no inline assembly) the adds are
    plain atomics and no ticket is touched. ``mask`` (None: all) limits the adds to the rows that
    exist: a packed sequence's tile may start before its first row.
    """
    if WAITS:
        after_math = tl.max(tl.max(dq, axis=1), axis=0).to(tl.int32, bitcast=True)
        seen = _release_then_poll(held, held_amount, ticket_ptr, after_math)
        seen = _spin_until(ticket_ptr, rank, seen, ERR, max_spin)
        tl.atomic_add(acc_ptrs + _opaque_zero(seen) * 16, dq, mask=mask,
                      sem="relaxed")  # keeps alignment
    else:
        tl.atomic_add(acc_ptrs, dq, mask=mask, sem="relaxed")
    return ticket_ptr, 1


@triton.jit
def release_last(held, held_amount, WAITS: tl.constexpr):
    """After a program's last step: wait for all its threads, then release the ticket it holds.

    A program that took no step holds nothing, and its ``held`` is the ticket array's base, which
    is no address at all when the array is empty (a packed call without queries): no release."""
    if WAITS:
        tl.debug_barrier()
        tl.atomic_add(held, held_amount, mask=held_amount != 0, sem="release")
