"""Print each failed or errored test of a junit XML with the first lines of its message.

``gpu_check.sh`` writes these into summary.txt: a device call brings back at most 8 files, so
the XML itself is often left behind, and a ``pytest -v`` log cut by the call's time limit names
a failure without saying why (a timeout or an assertion).
Usage: python3 scripts/junit_failures.py JUNIT.xml [MAX_LINES]
"""
import sys
import xml.etree.ElementTree as ET


def failures(path: str, max_lines: int = 3):
    for case in ET.parse(path).iter("testcase"):
        for kind in ("failure", "error"):
            for node in case.findall(kind):
                name = f"{case.get('classname')}::{case.get('name')}"
                text = (node.get("message") or node.text or "").strip().splitlines()
                yield f"{kind.upper()} {name} ({case.get('time')} s): " + " | ".join(text[:max_lines])


if __name__ == "__main__":
    for line in failures(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        print(line[:600])
