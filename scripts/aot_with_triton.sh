#!/usr/bin/env bash
# scripts/aot_compile_check.py under another Triton release than the one installed (which is
# vLLM's), e.g. the GPU machine's: Triton releases lower the same Gluon code differently, and a
# kernel that compiles with one can fail with another. The release goes into its own venv
# (cached in $AOT_TRITON_VENVS, default ~/.cache/moonep_ops/aot-triton-<version>) that sees the
# current Python's packages through a .pth file, so only Triton differs. Needs network once per
# release (pip download).
#   bash scripts/aot_with_triton.sh 3.6.0 --targets 90 --dtypes bf16 --no-portable
set -euo pipefail
version=${1:?usage: scripts/aot_with_triton.sh TRITON_VERSION [aot_compile_check.py arguments]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${AOT_TRITON_VENVS:-$HOME/.cache/moonep_ops}/aot-triton-$version
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --no-deps "triton==$version"
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# the current Python's packages (torch, moonep_ops' dependencies), after the venv's own Triton;
# written on every run, so that the cached venv follows whichever Python runs this
"$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/zz_outer_site.pth"
"$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
exec "$venv/bin/python" scripts/aot_compile_check.py "$@"
