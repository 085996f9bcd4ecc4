"""Sort compute-sanitizer racecheck reports: Triton's warp-specialization handshake, or ours.

Triton lowers ``gl.warp_specialize`` with a handshake through shared memory: the default warps
write each worker warp's partition index and the captured arguments, named barriers order them,
and the workers read them. racecheck reports hazards on it in a kernel with a prologue that
reduces across warps and two worker partitions, as the Gluon GEMM has; the 40-line control
``scripts/racecheck_control.py`` (no moonep code) reproduces them (twelfth session, H200,
Triton 3.6.0, compute-sanitizer 2025.3.1). Those reports name only the kernel's ``def`` line
and the line that holds its ``warp_specialize`` call (or the ``if`` around it).

A report is *handshake* when every access it names is at such a line of a file that calls
``warp_specialize``; anything else is *ours*. Passes (exit 0) when no report is ours, every
report was printed (blocks == the summary's count), and the control log shows the handshake
pattern too (so a Triton that fixes it, leaving ours, fails). Exit 1 otherwise.

Usage: python scripts/racecheck_triage.py racecheck.log --control racecheck_control.log
"""

import argparse
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ACCESS = re.compile(r"(Read|Write) access at (\S+) in (\S+?):(\d+)")
SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def handshake_lines(path: pathlib.Path) -> set[int]:
    """The ``def`` line of each function that calls ``warp_specialize``, the call's lines and the
    lines of the ``if`` statements around the call."""
    lines = set()
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "warp_specialize"]
        if not calls:
            continue
        lines.add(fn.lineno)
        for call in calls:
            lines.add(call.lineno)
        for node in ast.walk(fn):
            if isinstance(node, ast.If) and any(c in list(ast.walk(node)) for c in calls):
                lines.add(node.lineno)
    return lines


def allowed_lines(root: pathlib.Path = ROOT) -> dict[str, set[int]]:
    """Basename -> handshake lines, for every Python file here that calls ``warp_specialize``."""
    allowed = {}
    for path in [*root.glob("moonep_ops/**/*.py"), *root.glob("scripts/*.py")]:
        if "warp_specialize(" in path.read_text():
            allowed[path.name] = handshake_lines(path)
    return allowed


def reports(text: str) -> list[list[tuple[str, int]]]:
    """Each race report as its list of (file, line) accesses."""
    out = []
    for line in text.splitlines():
        if "Race reported between" in line:
            out.append([])
        if out and ("Race reported between" in line or line.lstrip("= ").startswith("and ")):
            out[-1] += [(m.group(3).split("/")[-1], int(m.group(4))) for m in ACCESS.finditer(line)]
    return out


def classify(text: str, allowed) -> tuple[int, int, int]:
    """(handshake reports, our reports, reports the summaries count)."""
    hand = ours = 0
    for accesses in reports(text):
        if accesses and all(line in allowed.get(name, ()) for name, line in accesses):
            hand += 1
        else:
            ours += 1
    counted = sum(int(m.group(1)) for m in SUMMARY.finditer(text))
    return hand, ours, counted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--control", required=True)
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose sources the logs' lines refer to")
    args = parser.parse_args(argv)
    allowed = allowed_lines(pathlib.Path(args.root))
    hand, ours, counted = classify(pathlib.Path(args.log).read_text(errors="replace"), allowed)
    c_hand, c_ours, _ = classify(pathlib.Path(args.control).read_text(errors="replace"), allowed)
    ok = ours == 0 and hand + ours == counted and (hand == 0 or (c_hand > 0 and c_ours == 0))
    print(f"racecheck triage: {hand} report(s) in Triton's warp-specialization handshake, {ours} elsewhere, "
          f"{counted} counted by the summaries; control: {c_hand} handshake, {c_ours} elsewhere -> "
          f"{'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
