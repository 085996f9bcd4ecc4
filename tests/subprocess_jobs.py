"""Test suites that run as whole subprocesses (the Triton kernels under ``TRITON_INTERPRET=1``, the
ahead-of-time compile check), started in the background as soon as pytest has collected the
tests that need them.

They take minutes of one core each, while most of the suite runs in the main pytest process on
one core: the jobs run on two background threads (one subprocess each at a time) beside the
in-process tests, and each test only waits for its job's result (``result``; the tests that do
are ordered last, so they find their jobs done or nearly). A test marked
``@pytest.mark.subprocess_job("name")`` declares its job (``conftest.py`` prestarts them);
without a prestart (a pytest-xdist worker, or a job not declared) ``result`` runs the job then.
Nothing here is shared between jobs but the thread: each writes its output to its own file.
"""

import importlib.metadata
import importlib.util
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pytest(path):
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]


def _aot(*args):
    return [sys.executable, "scripts/aot_compile_check.py", *args]


# name -> (argv, environment overrides, timeout in seconds), in the order the background thread
# runs them (longest first).
JOBS = {
    "interpreter_forward": (_pytest("tests/interpreter_cases.py"), {"TRITON_INTERPRET": "1"}, 1200),
    "aot_sm90": (_aot("--targets", "90", "--dtypes", "bf16"), {"TRITON_INTERPRET": "0"}, 1200),
    "aot_table": (_aot("--table"), {"TRITON_INTERPRET": "0"}, 1200),
    "interpreter_backward": (_pytest("tests/interpreter_backward_cases.py"), {"TRITON_INTERPRET": "1"}, 900),
    "aot_sm86": (_aot("--targets", "86", "--dtypes", "bf16,fp32"), {"TRITON_INTERPRET": "0"}, 1200),
    "aot_selftest": (_aot("--selftest"), {"TRITON_INTERPRET": "0"}, 600),
}
_WAIT_S = sum(t for _, _, t in JOBS.values())  # a job may queue behind all the others
WORKERS = 2  # background threads, each running one subprocess at a time


class _Job:
    def __init__(self, name):
        self.name = name
        self.done = threading.Event()
        self.returncode = None
        self.output = ""
        self.proc = None

    def run(self):
        argv, env, timeout = JOBS[self.name]
        if _stopping.is_set():
            self.returncode = "not run: the session ended first"
            self.done.set()
            return
        try:
            with tempfile.TemporaryFile(mode="w+") as log:
                self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                                             stderr=subprocess.STDOUT, text=True)
                try:
                    self.returncode = self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    self.returncode = f"timeout after {timeout} s"
                log.seek(0)
                self.output = log.read()
        except Exception as exc:  # reported by the test that asks for the result
            self.returncode = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()


_jobs: dict = {}
_lock = threading.Lock()
_stopping = threading.Event()


def available() -> bool:
    """Every job needs Triton (the interpreter or the compiler)."""
    return importlib.util.find_spec("triton") is not None


def _release(dist: str) -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version(dist).split("+")[0].split(".")[:2])


def unusable(name) -> str | None:
    """Why job ``name`` cannot run in this environment (its tests skip with that reason), or None.
    The interpreter runs kernels on NumPy arrays; Triton 3.6's (torch 2.11's) turns a one-element
    array into a Python int in a way NumPy 2.4 refuses (triton-lang/triton#9171, fixed in 3.7)."""
    if name.startswith("interpreter"):
        if importlib.util.find_spec("numpy") is None:
            return "the Triton interpreter needs NumPy (pip install numpy)"
        if _release("triton") < (3, 7) and _release("numpy") >= (2, 4):
            return (f"Triton {importlib.metadata.version('triton')}'s interpreter fails under NumPy "
                    f"{importlib.metadata.version('numpy')} (triton-lang/triton#9171): use numpy<2.4 or Triton >= 3.7")
    return None


def prestart(names) -> None:
    """Run the named jobs on ``WORKERS`` background threads, taken in ``JOBS`` order."""
    pending, wanted = queue.SimpleQueue(), set(names)
    with _lock:
        for name in JOBS:
            if name in wanted and name not in _jobs and unusable(name) is None:
                _jobs[name] = _Job(name)
                pending.put(_jobs[name])

    def work():
        while True:
            try:
                job = pending.get_nowait()
            except queue.Empty:
                return
            job.run()

    for i in range(WORKERS):
        threading.Thread(target=work, name=f"subprocess-jobs-{i}", daemon=True).start()


def result(name):
    """``(returncode, output)`` of job ``name``: waits for the background run, or runs it now."""
    with _lock:
        job = _jobs.get(name)
        run_here = job is None
        if run_here:
            job = _jobs[name] = _Job(name)
    if run_here:
        job.run()
    if not job.done.wait(timeout=_WAIT_S):
        return f"no result within {_WAIT_S} s", job.output
    return job.returncode, job.output


def stop_all() -> None:
    """Kill what still runs and start nothing more (the session ended early, e.g. -x)."""
    _stopping.set()
    with _lock:
        jobs = list(_jobs.values())
    for job in jobs:
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
