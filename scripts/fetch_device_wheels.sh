#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the cp312 manylinux wheels of what tidal needs and the lent
# GPU machine lacks (it has torch, triton, transformers, tokenizers, safetensors, numpy, uvloop,
# psutil, prometheus-client, tqdm, jinja2, pytest, pytest-timeout; see
# /work/.library/device/KINDS.md). scripts/device_check.sh installs them there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Only what the check imports is fetched: pyzmq and msgspec (the front-end <-> core wire).
# fastapi/uvicorn/httptools (the server) and xgrammar (structured outputs) are not imported
# by LLM.generate or the GPU tests. Neither wheel has install requirements on CPython.
# Usage (repo root or anywhere): scripts/fetch_device_wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
PKGS=(pyzmq==27.3.0 msgspec==0.23.0)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${PKGS[@]}"
# Keep one version of each (two stop the whole install there).
for name in pyzmq msgspec; do
    n=$(ls .whl | grep -ci "^${name}-" || true)
    if [ "$n" != 1 ]; then echo "expected one $name wheel in .whl, found $n:" >&2; ls .whl >&2; exit 1; fi
done
ls -l .whl
du -sh .whl
