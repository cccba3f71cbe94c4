#!/usr/bin/env bash
# The wheels a GPU machine without a package index lacks (docs/gpu.md): the machines lent here carry PyTorch,
# transformers, accelerate, peft, imageio and the scientific stack, not diffusers, open_clip or torchao.
# Downloads them, without their dependencies, for CPython 3.12 on x86-64 Linux into .whl/ (git-ignored, 13 MB):
#     scripts/gpu_wheels.sh [FOLDER]
# and on the GPU machine, from the repository's root:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#     python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
set -euo pipefail
folder="${1:-.whl}"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$folder" \
    diffusers==0.42.1 open-clip-torch==3.3.0 torchao==0.18.0 peft==0.21.2 timm==1.0.22 ftfy==6.3.1 wcwidth==0.9.4 importlib_metadata==10.2.0
du -sh "$folder"
