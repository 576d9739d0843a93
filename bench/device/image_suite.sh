#!/usr/bin/env bash
# The test suite on the CPU with the device image's versions (torch 2.11.0+cu130, lightning 2.6.6,
# transformers 5.17.0): what CI (torch 2.13 CPU) cannot show before a device run. The torch wheel is the
# CUDA build (the registry has no 2.11 CPU build): ~4.7 GB in the venv, ~1 minute to install here; the
# CUDA libraries load and report no device. Run from the repository root:
#   bash bench/device/image_suite.sh [VENV] [pytest args...]
# (default VENV /tmp/device-image-venv; default pytest args: the whole suite, as the README runs it).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-/tmp/device-image-venv}"
shift || true
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U "setuptools<82" wheel  # the packaging tests build a wheel without isolation
  "$VENV/bin/pip" install -q torch==2.11.0
  "$VENV/bin/pip" install -q "lightning==2.6.6" "transformers==5.17.0" "pyomo>=6.7" "highspy>=1.7" \
    "hydra-core>=1.3" "omegaconf>=2.3" "matplotlib>=3.7" "bitsandbytes>=0.50" "jsonargparse[signatures]>=4.27" \
    "pytest>=8" "hypothesis>=6.100" "pytest-xdist>=3.5"
fi
"$VENV/bin/python" -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', \
lightning.__version__, 'transformers', transformers.__version__)"
if [ "$#" -eq 0 ]; then
  set -- -q -n auto --dist loadfile
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
