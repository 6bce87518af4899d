"""The contract of packed-sequence offsets (``cu_seq_q``, ``cu_seq_k``) and the wording of each
breach, shared by the host check (CPU tensors, ``dash_inductor/library/packing.py``) and the device check
(CUDA, ``offsets_check.py``), which reports breaches as bits of an error flag. Plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence

WHERE = "dash.varlen_attention"

#: Bits of the device check's flag, in the order the host check reports them; the keys' bits are
#: the queries' shifted left by KEYS.
START, ORDER, END, LONGEST = 1, 2, 4, 8
KEYS = 4
_NAMES = (("cu_seq_q", "Tq", "max_q"), ("cu_seq_k", "Tk", "max_k"))


def breach(name: str, bit: int, total: int, max_len: int, got: str = "") -> str:
    """The error message of one breach of ``name``'s contract (``got``: the values, if known)."""
    total_name, max_name = dict((n, (t, m)) for n, t, m in _NAMES)[name]
    text = {START: f"{name} must start at 0",
            ORDER: f"{name} must be non-decreasing",
            END: f"{name}[-1] must equal the number of packed tokens {total_name}={total}",
            LONGEST: f"{max_name}={max_len} is smaller than the longest sequence in {name}"}[bit]
    return f"{WHERE}: {text}{got}"


def host_breach(name: str, values: Sequence[int], total: int, max_len: int) -> str | None:
    """The first breach of offsets read on the host, with the values in the message; None if
    they keep the contract."""
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0:
        return breach(name, START, total, max_len, f", got {values[0]}")
    if any(n < 0 for n in lengths):
        return breach(name, ORDER, total, max_len, f", got {list(values)}")
    if values[-1] != total:
        return breach(name, END, total, max_len, f", got {values[-1]}")
    longest = max(lengths, default=0)
    if longest > max_len:
        return breach(name, LONGEST, total, max_len, f" ({longest})")
    return None


def device_breach(code: int, totals: tuple[int, int], max_lens: tuple[int, int]) -> str:
    """The message of the first breach in a device check's flag (queries before keys)."""
    for index, (name, _, _) in enumerate(_NAMES):
        bits = code >> (KEYS * index)
        for bit in (START, ORDER, END, LONGEST):
            if bits & bit:
                return (breach(name, bit, totals[index], max_lens[index])
                        + " (found by the device check of a launch on packed sequences; its "
                        "outputs are invalid)")
    raise ValueError(f"no breach in offsets check code {code}")
