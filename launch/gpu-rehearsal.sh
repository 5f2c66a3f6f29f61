#!/usr/bin/env bash
# The lent GPU's checks (launch/gpu-checks.sh) rehearsed on this CPU under the torch and transformers the lent
# machines have (docs/gpu.md: torch 2.11.0, transformers 5.17.0; no torchvision assumed), so that what would fail
# there for a version's sake fails here, not in the GPU's few minutes. It checks that the checks run and write what
# they should, not what a GPU measures: the CUDA tests skip here, and the model is tiny.
#   bash launch/gpu-rehearsal.sh OUT_DIR [CHECK ...]   (default checks: tests engine-compile engine-library run)
# A virtual environment of its own, made when missing and reused after (REHEARSAL_VENV, default
# /tmp/computerrl-gpu-rehearsal; one with other versions is refused, never removed;
# about 5 GB and a few minutes the first time: PyPI's torch is the CUDA build, which also runs on a CPU). Versions:
# REHEARSAL_TORCH, REHEARSAL_TRANSFORMERS. Then, under them: the engine's, the VLM policy's and the GPU checks' own
# tests (slow ones too), and each check through gpu-checks.sh on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash launch/gpu-rehearsal.sh OUT_DIR [CHECK ...]" >&2; exit 2; }
out="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
[ $# -gt 0 ] || set -- tests engine-compile engine-library run
venv="${REHEARSAL_VENV:-/tmp/computerrl-gpu-rehearsal}"
torch_version="${REHEARSAL_TORCH:-2.11.0}"
transformers_version="${REHEARSAL_TRANSFORMERS:-5.17.0}"
py="${PYTHON:-python3}"
ready() {  # the venv has what a rehearsal imports, at the versions asked for
  "$venv/bin/python" -c "import torch, transformers, zmq, pytest, xdist" 2>/dev/null && \
    [ "$("$venv/bin/python" -c 'import torch, transformers; print(torch.__version__.split("+")[0], transformers.__version__)')" \
      = "$torch_version $transformers_version" ]
}
if [ -e "$venv" ] && ! ready; then  # never removed here: REHEARSAL_VENV may name an environment someone uses
  echo "[gpu-rehearsal] $venv is not a rehearsal environment with torch $torch_version and transformers" \
       "$transformers_version (or its install was cut short): remove it, or set REHEARSAL_VENV to another path" >&2
  exit 2
fi
if [ ! -e "$venv" ]; then
  echo "[gpu-rehearsal] installing torch $torch_version and transformers $transformers_version into $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # setup.cfg's requirements and test extra, torch and transformers at the lent machines' versions instead of ours
  mapfile -t reqs < <("$py" - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["test"].splitlines()
print("\n".join(l.strip() for l in lines if l.strip() and not l.strip().startswith(("torch", "transformers"))))
PY
)
  "$venv/bin/python" -m pip install -q "torch==$torch_version" "transformers==$transformers_version" "${reqs[@]}"
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee "$out/versions.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo "== tests: the engine, the VLM policy and the GPU checks, slow ones too" | tee "$out/rehearsal.txt"
if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 tests/test_engine.py tests/test_vlm_policy.py \
     tests/test_gpu_checks.py > "$out/tests.txt" 2>&1; then
  status=1
fi
tail -3 "$out/tests.txt" | tee -a "$out/rehearsal.txt"
for check in "$@"; do
  echo "== $check" | tee -a "$out/rehearsal.txt"
  rm -rf "${out:?}/$check"
  PYTHON="$venv/bin/python" GPU_CHECKS_DEVICE=cpu GPU_CHECKS_MODEL="--hidden 32 --layers 2" \
    GPU_CHECKS_SMALL="--prompt-len 64 --new-tokens 16 --mixed-episodes 16" \
    GPU_CHECKS_RUN_MODEL="model.arch=qwen2 model.hidden_size=64 model.num_layers=2 model.num_heads=4 \
model.num_kv_heads=2 model.intermediate_size=128 model.vocab_size=1024 actor.engine.overlap=always" \
    bash launch/gpu-checks.sh "$check" "$out/$check" > "$out/$check.txt" 2>&1 || true
  # what the check must have written (gpu-checks.sh goes on past a failing step, so its exit says little)
  if ! "$venv/bin/python" -m launch.rehearsal_outputs "$check" "$out/$check" 2>&1 | tee -a "$out/rehearsal.txt"; then
    status=1
  fi
done
echo "[gpu-rehearsal] $([ $status -eq 0 ] && echo passed || echo FAILED): $out/rehearsal.txt" >&2
exit $status
