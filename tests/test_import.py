"""``import moonep_ops`` needs neither vLLM nor Triton, and imports neither eagerly.

Each case runs in a fresh interpreter, so modules that other tests imported cannot hide an
eager import, and blocking vLLM cannot leak into the rest of the session.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How vLLM is made unimportable in the child, before anything else runs.
BLOCKERS = {
    # A finder that refuses vllm and every submodule, as if it were not installed.
    "meta_path": """
        import importlib.abc, sys
        class _NoVllm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
                return None
        sys.meta_path.insert(0, _NoVllm())
    """,
    # The sys.modules convention: None makes `import vllm` raise ImportError.
    "sys_modules_none": """
        import sys
        sys.modules["vllm"] = None
    """,
}

CHILD = """
import sys
{blocker}
try:
    import vllm  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block vllm")

import torch  # noqa: E402

before = set(sys.modules)
import moonep_ops  # noqa: E402
new = sorted(set(sys.modules) - before)

# The ops are usable: registered, and a tiny call runs on CPU.
a = torch.randn(4, 8)
w = torch.randn(2, 3, 8)
cu = torch.tensor([1, 3], dtype=torch.int32)
out = moonep_ops.grouped_gemm(a, w, cu)
assert out.shape == (4, 3), out.shape
assert torch.equal(out[3:], torch.zeros(1, 3)), out
assert torch.allclose(out[:1], a[:1] @ w[0].T, atol=1e-5, rtol=1e-5)

eager = [m for m in new if m.split(".")[0] in ("vllm", "triton")]
print("NEW_MODULES", len(new))
print("EAGER", ",".join(eager))
"""


def _run_child(blocker: str) -> str:
    code = CHILD.format(blocker=textwrap.dedent(blocker))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("blocker", sorted(BLOCKERS))
def test_import_without_vllm(blocker):
    out = _run_child(BLOCKERS[blocker])
    lines = dict(line.split(" ", 1) if " " in line else (line, "")
                 for line in out.splitlines() if line.startswith(("NEW_MODULES", "EAGER")))
    assert int(lines["NEW_MODULES"]) > 0, out  # the import really happened in the child
    assert lines["EAGER"] == "", f"import moonep_ops imported {lines['EAGER']} eagerly"


def test_the_package_says_it_is_typed():
    """PEP 561: ``py.typed`` beside the package's modules, so type checkers read its annotations
    (pyproject.toml ships it)."""
    import importlib.resources

    assert importlib.resources.files("moonep_ops").joinpath("py.typed").is_file()
