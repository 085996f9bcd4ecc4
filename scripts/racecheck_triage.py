"""Sort compute-sanitizer racecheck reports: Triton's warp-specialization handshake, or ours.

Triton lowers ``gl.warp_specialize`` with a handshake through shared memory: the default warps
write each worker warp's partition index and the captured arguments, named barriers order them,
and the workers read them. racecheck reports hazards on it in a kernel with a prologue that
reduces across warps and two worker partitions, as the Gluon GEMM has; the small control
``scripts/racecheck_control.py`` (no moonep code) reproduces them (H200, Triton 3.6.0,
compute-sanitizer 2025.3.1). Those reports name only the kernel's ``def`` line and the line that
holds its ``warp_specialize`` call (or the ``if`` around it).

A report is *handshake* when it has exactly the shape seen there: Reads only at the ``def`` line
of a function that calls ``warp_specialize``, Writes only at that line or at the line Triton
gives the ``warp_specialize`` op (the innermost ``if`` whose branch holds the call, else the
call's own line), at least one of each, all in that one file, and every access line parsed.
Anything else is *ours*: another shape or line, an access line that does not parse, and any
other ``Error:``/``Warning:`` block (a crashed process, say). Passes (exit 0) when no report is
ours, the log has racecheck summaries that all parse and count exactly the reports found, and
the control log shows the handshake pattern too (so a Triton that fixes it, leaving ours,
fails). Exit 1 otherwise.

Run by scripts/sanitize.sh; by hand:
    python scripts/racecheck_triage.py racecheck.log --control racecheck_control.log
"""

import argparse
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ACCESS = re.compile(r"(Read|Write) access at \S+ in (\S+?):(\d+)(?: \[\d+ hazards?\])?\s*$")
SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)\s*$")


def handshake_lines(path: pathlib.Path) -> tuple[set[int], set[int]]:
    """(``def`` lines of the functions that call ``warp_specialize``, the lines Triton gives
    those calls: the innermost ``if`` whose branch holds the call as a statement, else the
    call's line)."""
    defs, ops = set(), set()
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        found = False
        for node in ast.walk(fn):
            branches = ([node.body, node.orelse] if isinstance(node, ast.If) else
                        [node.body] if isinstance(node, ast.FunctionDef) else [])
            for branch in branches:
                for stmt in branch:
                    if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                            and isinstance(stmt.value.func, ast.Attribute)
                            and stmt.value.func.attr == "warp_specialize"):
                        ops.add(node.lineno if isinstance(node, ast.If) else stmt.lineno)
                        found = True
        if found:
            defs.add(fn.lineno)
    return defs, ops


def allowed_lines(root: pathlib.Path = ROOT) -> dict[str, tuple[set[int], set[int]]]:
    """Basename -> (def lines, op lines), for every Python file here that calls ``warp_specialize``
    (two files of one basename: neither is trusted)."""
    allowed, seen = {}, set()
    for path in [*root.glob("moonep_ops/**/*.py"), *root.glob("scripts/*.py")]:
        if "warp_specialize(" in path.read_text():
            if path.name in seen:
                allowed.pop(path.name, None)
                continue
            seen.add(path.name)
            allowed[path.name] = handshake_lines(path)
    return allowed


def reports(text: str) -> tuple[list[list], int]:
    """(each race report as its list of accesses: (kind, file, line), or None for an access line
    that does not parse; the number of other Error/Warning blocks)."""
    out, other = [], 0
    for line in text.splitlines():
        body = line.lstrip("=").strip()
        if body.startswith(("Error:", "Warning:")):
            if "Race reported between" not in body:
                other += 1
                out.append(None)
                continue
            out.append([])
            body = body.split("Race reported between", 1)[1]
        elif not (out and out[-1] is not None and body.startswith("and ")):
            continue
        m = ACCESS.search(body)
        out[-1].append((m.group(1), m.group(2).split("/")[-1], int(m.group(3))) if m else None)
    return [r for r in out if r is not None], other


def is_handshake(accesses, allowed) -> bool:
    if not accesses or None in accesses:
        return False
    names = {name for _, name, _ in accesses}
    if len(names) != 1 or next(iter(names)) not in allowed:
        return False
    defs, ops = allowed[next(iter(names))]
    kinds = {kind for kind, _, _ in accesses}
    # Reads only at the def line (the workers' read of their partition index), writes at the def
    # line or the op's line (the default warps' writes of it), at least one of each.
    return (kinds == {"Read", "Write"}
            and all(line in defs if kind == "Read" else (line in defs or line in ops) for kind, _, line in accesses))


def classify(text: str, allowed) -> tuple[int, int, int | None]:
    """(handshake reports, our reports, reports the summaries count, or None when a summary line
    does not parse or there is none)."""
    found, other = reports(text)
    hand = sum(is_handshake(r, allowed) for r in found)
    ours = len(found) - hand + other
    lines = [ln for ln in text.splitlines() if "RACECHECK SUMMARY" in ln]
    matches = [SUMMARY.search(ln) for ln in lines]
    counted = sum(int(m.group(1)) for m in matches) if lines and all(matches) else None
    return hand, ours, counted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--control", required=True)
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose sources the logs' lines refer to")
    args = parser.parse_args(argv)
    allowed = allowed_lines(pathlib.Path(args.root))
    hand, ours, counted = classify(pathlib.Path(args.log).read_text(errors="replace"), allowed)
    c_hand, c_ours, c_counted = classify(pathlib.Path(args.control).read_text(errors="replace"), allowed)
    ok = (ours == 0 and counted is not None and hand == counted
          and (hand == 0 or (c_hand > 0 and c_ours == 0 and c_counted == c_hand)))
    print(f"racecheck triage: {hand} report(s) in Triton's warp-specialization handshake, {ours} elsewhere, "
          f"{counted} counted by the summaries; control: {c_hand} handshake, {c_ours} elsewhere -> "
          f"{'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
