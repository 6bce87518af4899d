"""The triage of a compute-sanitizer racecheck log of the Hopper kernels (``bench/racecheck.py
--triage LOG``): its hazards grouped by (kind, first access, second access), each group marked
known where it is one of the two false positives docs/racecheck.md explains, found by source line
(and, in a ``--racecheck-report hazard`` log, address span) in the installed sources.

A ``hazard`` log prints each hazard, up to the sanitizer's print limit, with its address; an
``analysis`` log prints each pair of racing instructions once, with its count, so it covers every
hazard of a run that would print millions."""

from __future__ import annotations

import ast
import pathlib
import re

_HAZARD = re.compile(r"Potential (\w+) hazard detected at __shared__ (0x[0-9a-fA-F]+) in block "
                     r"\(([^)]*)\)")
_ACCESS = re.compile(r"(Read|Write) Thread \(([^)]*)\) at (\S+) in (\S+?):(\d+)")
#: ``--racecheck-report analysis``: "Race reported between <access>", then "and <access> [N
#: hazards]" for each instruction it races with.
_RACE = re.compile(r"Race reported between (Read|Write) access at (\S+) in (\S+?):(\d+)")
_PARTNER = re.compile(r"and (Read|Write) access at (\S+) in (\S+?):(\d+) \[(\d+) hazards?\]")


def _lines_with(path, snippet: str) -> set[int]:
    return {n for n, text in enumerate(path.read_text().splitlines(), 1) if snippet in text}


def _is_warp_specialize(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "warp_specialize")


def known_handoffs() -> list[tuple[str, dict[str, set[int]], dict[str, set[int]], int]]:
    """The hand-offs whose racecheck hazards are known false positives (docs/racecheck.md),
    as (what, lines of the first access by file, lines of the second by file, widest span of
    addresses in bytes), found in the installed sources (so line numbers follow edits; a rewrite
    of a line makes its hazards UNKNOWN, the safe side):

    - Triton's warp-specialization state bytes: stored by the default warps before each region
      and before the exit (at the kernel's ``def`` line and its ``gl.warp_specialize(`` line, or
      the ``if`` that holds that call, where Triton 3.6 puts the exit store), read by the worker
      warps in the switch loop (the ``def`` line); ordered by ``barrier.sync 1``.
    - The dQ partial: stored by the compute warps (``dq_bufs.index(d).store``), read from shared
      memory by the writer (``buf.slice(r, ROWS, dim=0).load``: packed sub-tiles that cross an
      edge, and the red.v4 writer); ordered by the named barrier (``bar.arrive`` / ``bar.sync``)
      or the ``dq_ready`` mbarrier.
    """
    from dash_inductor.ops import hopper

    folder = pathlib.Path(hopper.__file__).parent
    state: dict[str, set[int]] = {}
    for path in sorted(folder.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls = [c.lineno for c in ast.walk(fn) if _is_warp_specialize(c)]
            branches = [b.lineno for b in ast.walk(fn) if isinstance(b, ast.If)
                        and any(_is_warp_specialize(c) for c in ast.walk(b))]
            if calls:
                state.setdefault(path.name, set()).update({fn.lineno, *calls, *branches})
    partial_store = {"backward.py": _lines_with(folder / "backward.py", "dq_bufs.index(d).store(")}
    partial_load = {"dq_writer.py": _lines_with(folder / "dq_writer.py",
                                                "buf.slice(r, ROWS, dim=0).load(")}
    # The state is one byte per worker warp (at most 16 warps a CTA besides the default's); a dQ
    # partial is BLOCK_M x D fp32 (at most 128 x 128).
    return [("Triton's warp_specialize state bytes, ordered by barrier.sync 1", state, state, 16),
            ("dQ partial hand-off, ordered by the named barrier or dq_ready", partial_store,
             partial_load, 128 * 128 * 4)]


def triage(log_path: str) -> int:
    """Group a ``--racecheck-report hazard`` log's hazards by (kind, first access, second access)
    and say which are known false positives (``known_handoffs``; docs/racecheck.md). Exit
    status 1 if any other hazard is there."""
    known = known_handoffs()
    groups: dict[tuple, dict] = {}
    hazard = race = None
    with open(log_path, errors="replace") as log:
        for line in log:
            start = _RACE.search(line)
            if start:
                race = (start.group(1), start.group(2), start.group(3).rsplit("/", 1)[-1],
                        int(start.group(4)))
                continue
            partner = _PARTNER.search(line)
            if race is not None and partner:
                other = (partner.group(1), partner.group(2),
                         partner.group(3).rsplit("/", 1)[-1], int(partner.group(4)))
                # The write first, as a hazard log prints it; the log does not say which of the
                # two came first in time, so the kind is only "race".
                first, second = (other, race) if other[0] == "Write" else (race, other)
                kind = "race"
                key = (kind, first[0], first[1], first[2], first[3], second[0], second[1],
                       second[2], second[3])
                group = groups.setdefault(key, {"count": 0, "addresses": set(), "blocks": set(),
                                                "threads": set()})
                group["count"] += int(partner.group(5))
                continue
            head = _HAZARD.search(line)
            if head:
                hazard = {"kind": head.group(1), "address": int(head.group(2), 16),
                          "block": head.group(3).replace(" ", ""), "accesses": []}
                continue
            access = _ACCESS.search(line)
            if hazard is None or not access:
                continue
            hazard["accesses"].append((access.group(1), access.group(2).replace(" ", ""),
                                       access.group(3), access.group(4).rsplit("/", 1)[-1],
                                       int(access.group(5))))
            if len(hazard["accesses"]) == 2:
                first, second = hazard["accesses"]
                key = (hazard["kind"], first[0], first[2], first[3], first[4], second[0],
                       second[2], second[3], second[4])
                group = groups.setdefault(key, {"count": 0, "addresses": set(), "blocks": set(),
                                                "threads": set()})
                group["count"] += 1
                group["addresses"].add(hazard["address"])
                group["blocks"].add(hazard["block"])
                group["threads"].add((first[1], second[1]))
                hazard = None
    unknown = 0
    total = sum(g["count"] for g in groups.values())
    print(f"# {log_path}: {total} hazards in {len(groups)} groups")
    for key, g in sorted(groups.items(), key=lambda kv: -kv[1]["count"]):
        kind, kind1, pc1, file1, line1, kind2, pc2, file2, line2 = key
        span = max(g["addresses"]) - min(g["addresses"]) if g["addresses"] else 0
        what = next((what for what, first, second, widest in known
                     if line1 in first.get(file1, ()) and line2 in second.get(file2, ())
                     and span < widest), None)
        unknown += what is None
        threads = sorted(g["threads"])[:4]
        where = ""
        if g["addresses"]:  # a hazard log's
            where = (f"; addresses {', '.join(hex(a) for a in sorted(g['addresses'])[:4])}"
                     f"{', ...' if len(g['addresses']) > 4 else ''}; {len(g['blocks'])} blocks; "
                     f"threads {threads}")
        print(f"{'known  ' if what else 'UNKNOWN'} {g['count']:6d} {kind} {kind1} {pc1} "
              f"({file1}:{line1}) / {kind2} {pc2} ({file2}:{line2}){where}"
              + (f"  [{what}]" if what else ""))
    return 1 if unknown else 0
