#!/usr/bin/env bash
# The README's test command under another torch release than the installed one (which is vLLM's),
# e.g. the GPU machine's 2.11.0 with its Triton 3.6.0: the package supports torch >= 2.11, and a
# test, a torch API or a Triton interpreter that behaves differently there shows up here on the CPU
# instead of in device time. The release goes into its own venv (cached in $TORCH_VENVS, default
# ~/.cache/moonep_ops/torch-<version>) with the package (editable) and its test extra, no vLLM (the
# vLLM tests skip). About 5 GB of wheels (a CUDA build of torch) the first time; needs network then.
#   bash scripts/test_with_torch.sh 2.11.0                  # the whole suite
#   bash scripts/test_with_torch.sh 2.11.0 tests/test_fp8.py -k cpu
# NUMPY=X.Y.Z pins NumPy there (Triton 3.6's interpreter needs NumPy < 2.4: its tests skip otherwise).
set -euo pipefail
version=${1:?usage: scripts/test_with_torch.sh TORCH_VERSION [pytest arguments]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${TORCH_VENVS:-$HOME/.cache/moonep_ops}/torch-$version
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version"
fi
"$venv/bin/python" -m pip install -q -e ".[test]" "numpy${NUMPY:+==$NUMPY}"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
print(", ".join(f"{d} {md.version(d)}" for d in ("torch", "triton", "numpy")))
PY
if [ "$#" -eq 0 ]; then
    set -- -n auto
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
