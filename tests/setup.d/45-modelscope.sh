#!/usr/bin/env bash
# The official ModelScope client (modelscope + modelscope-hub, pure Python, test-only: the source
# itself speaks the Hub's HTTP API), which tests/test_modelscope.py drives against our test Hub
# to show it is ModelScope-shaped. Into the project's venv; a no-op when the pinned version is there.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=1.40.2
if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('modelscope') != '$version')" 2>/dev/null; then
  exit 0
fi
.venv/bin/pip install -q "modelscope==$version"
