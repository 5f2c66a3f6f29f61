#!/usr/bin/env bash
# The vllm engine's contract (tests/test_vllm_contract.py) checked against a real vLLM on a machine without a GPU:
# vLLM of the `gpu` extra's series installed beside the CPU build of the torch pin, in a virtual environment of its
# own (about 6 GB and 5 minutes the first time), then the test run there. vLLM's names and signatures import on a
# CPU; it cannot generate there (its PyPI build is CUDA's), so this checks names and keywords, not behaviour.
#   bash launch/vllm-contract.sh [VENV]      VENV defaults to /tmp/computerrl-vllm and is reused when it exists
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-/tmp/computerrl-vllm}"
py="${PYTHON:-python3}"
read -r vllm torch_pin < <("$py" - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
extra = [l.strip() for l in cfg["options.extras_require"]["gpu"].splitlines() if l.strip().startswith("vllm")]
pin = [l.strip() for l in cfg["options"]["install_requires"].splitlines() if l.strip().startswith("torch==")]
print(extra[0], pin[0])
PY
)
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[vllm-contract] installing $vllm beside $torch_pin (CPU) into $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$torch_pin"
  "$venv/bin/python" -m pip install -q "$vllm"
  # PyPI's torchvision, torchaudio and torchcodec do not load beside the CPU torch ("operator torchvision::nms does
  # not exist"); transformers and vLLM import without them
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "$venv/bin/python" -m pip install -q pytest pytest-timeout structlog msgpack PyNaCl
fi
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
PYTHONPATH="$PWD" exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= tests/test_vllm_contract.py
