"""Copies of the package against each other on the benchmark shapes, in alternating processes.

A kernel change is not a config field, so :mod:`benchmarks.ab` cannot vary it in one process (a
kernel compiles once per process). This times the experts op with each copy's own config table in a
fresh process per round and copy (``python -m benchmarks.ab table --rounds 1``), the copies' order
reversed every other round so that the board's drift falls on all of them, and pairs each round's
samples::

    python -m benchmarks.ab_code --export HEAD~1 ../base          # moonep_ops and fake_impls of a revision
    python -m benchmarks.ab_code ../base --rounds 6 --fp8 --shapes 0,3 --paddings 128
    python -m benchmarks.ab_code ../base ../probe1 ../probe2 --rounds 4 --fp8   # more copies, one run

Each directory holds a ``moonep_ops`` (and the ``fake_impls`` it imports) to run instead of this
checkout's; the benchmark code is this checkout's for all. The copies are ``base`` (the first
directory), the other directories by name, then ``current`` (this checkout). Prints one line per
shape and padding as :mod:`benchmarks.ab` does (each copy's samples, then each copy over ``base``
per round: median and range), and where a copy's output is more than 1e-2 from ``base``'s (a digest
of it: :func:`benchmarks.ab.check_reference`) or its tail is not zero, that error. Options other
than ``--rounds``, ``--out`` and ``--export`` go to :mod:`benchmarks.ab` as they are (``--fp8``,
``--shapes``, ``--paddings``, ``--cases``, ``--reps``, ``--settle``). Each process compiles its
kernels (Triton's disk cache makes every process after a copy's first quicker); on the H200 a
process per round and copy takes 10-40 s.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile

from . import ab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moonep_ops", "fake_impls")


def export(revision: str, directory: str) -> None:
    """``moonep_ops`` and ``fake_impls`` of git ``revision`` of this checkout into ``directory``
    (new or empty)."""
    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(f"benchmarks.ab_code: {directory} is not empty")
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", revision, *PACKAGES], stdout=archive,
                       check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            # (the "data" filter: no links out of the directory; Pythons before 3.10.12 lack it)
            tar.extractall(directory, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def process_env(directory: str | None) -> tuple:
    """``(cwd, env)`` of a process that imports ``moonep_ops`` from ``directory`` (None: this
    checkout) and ``benchmarks`` from this checkout."""
    env = dict(os.environ)
    path = [ROOT] if directory is None else [os.path.abspath(directory), ROOT]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # (python -m puts the working directory first on sys.path: the baseline's directory, or this checkout)
    return path[0], env


def package_file(directory: str | None) -> str:
    """Where ``moonep_ops`` comes from in such a process."""
    cwd, env = process_env(directory)
    return subprocess.run([sys.executable, "-c", "import moonep_ops; print(moonep_ops.__file__)"], cwd=cwd, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def run_ab(directory: str | None, ab_args: list, reference: str) -> list:
    """One ``benchmarks.ab table --rounds 1`` process with ``moonep_ops`` from ``directory``: its rows.
    ``reference``: the file of output digests that every process checks its outputs against (the
    first process writes it)."""
    cwd, env = process_env(directory)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ab.json")
        subprocess.run([sys.executable, "-m", "benchmarks.ab", "table", *ab_args, "--rounds", "1", "--out", out,
                        "--reference", reference], cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["rows"]


def copy_names(directories: list) -> list:
    """The copies' names: ``base`` for the first directory, the others' own names, then ``current``
    (this checkout). Raises ValueError where two would be the same."""
    names = ["base"] + [os.path.basename(os.path.normpath(d)) for d in directories[1:]] + ["current"]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmarks.ab_code: the copies need different names, got {names} (base and current "
                         f"are taken by the first directory and this checkout)")
    return names


def compare(rounds: int, run, copies: list) -> list:
    """``rounds`` rounds of ``run(copy)`` (a process's rows) for each of ``copies``, the order
    reversed every other round; returns rows in :mod:`benchmarks.ab`'s form with a variant per copy."""
    rows = None
    for r in range(rounds):
        for copy in ab.round_order(copies, r):
            got = run(copy)
            if rows is None:
                rows = [{"shape": g["shape"], "token_padding": g["token_padding"],
                         "samples": {c: [] for c in copies}, "errors": {}, "rounds": [{} for _ in range(rounds)]}
                        for g in got]
            for row, g in zip(rows, got, strict=True):
                if "table" in g["errors"]:
                    row["errors"][copy] = g["errors"]["table"]
                for us in g["samples"]["table"]:
                    row["samples"][copy].append(us)
                    row["rounds"][r][copy] = us
    return rows or []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # (abbreviations would take benchmarks.ab's options)
    parser.add_argument("baselines", nargs="+", metavar="DIR",
                        help="directories holding the moonep_ops (and fake_impls) to compare; the first is the base")
    parser.add_argument("--export", metavar="REVISION", default=None,
                        help="write REVISION's moonep_ops and fake_impls into DIR and exit (no GPU)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds: a process per copy each")
    parser.add_argument("--out", default=None, help="JSON file for the samples")
    args, ab_args = parser.parse_known_args(argv)  # the rest: benchmarks.ab's options
    if args.export:
        if len(args.baselines) != 1:
            parser.error("--export writes one directory")
        export(args.export, args.baselines[0])
        return 0
    try:
        names = copy_names(args.baselines)
    except ValueError as exc:
        parser.error(str(exc))
    directories = dict(zip(names, args.baselines + [None]))
    for directory in args.baselines:
        if not os.path.isdir(directory):
            parser.error(f"no directory {directory}")
        package = package_file(directory)
        if not package.startswith(os.path.abspath(directory) + os.sep):
            parser.error(f"moonep_ops imports from {package}, not from {directory}")
    with tempfile.TemporaryDirectory() as tmp:
        reference = os.path.join(tmp, "reference.pt")  # base's outputs, the first process's
        rows = compare(args.rounds, lambda copy: run_ab(directories[copy], ab_args, reference), names)
    for row in rows:
        print(ab._line(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copies": {name: directory and os.path.abspath(directory) for name, directory in
                                  directories.items()}, "ab_args": ab_args, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
