#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into build/wheels (ignored by git; carried to the machine with the working
# tree: the device tool's `carry: ["build/wheels"]`). That machine has torch and transformers but no internet and
# none of our pure dependencies; launch/gpu-checks.sh and launch/gpu-replay.sh install what is carried here into
# /tmp/site when `import zmq, structlog, msgpack` fails there.
#   bash launch/gpu-wheels.sh [PYTHON_VERSION]   (default 3.12, the lent machines'; about 5 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
# $PYTHON when set, else the bootstrap's virtual environment, else python3 (only its pip runs: it downloads, installs nothing)
py="${PYTHON:-}"
if [ -z "$py" ]; then if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi; fi
rm -rf build/wheels && mkdir -p build/wheels
# Our install_requires without torch, transformers and what they bring (numpy, PyYAML, Pillow come with them there),
# plus pytest's timeout plugin, which the tests' markers use. Binary wheels for the target's Python and Linux.
"$py" -m pip download -q --only-binary=:all: --implementation cp --python-version "$version" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d build/wheels pyzmq PyNaCl msgpack structlog click psutil pytest-timeout
ls build/wheels
du -sh build/wheels
