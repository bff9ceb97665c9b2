#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no network there): what benchmarks/gpu_check.sh
# needs beyond that machine's image (torch, transformers, h5py, aiohttp, nvidia-ml-py, ... are there).
# Run here, where PyPI is reachable; .whl/ is ignored by git and travels with `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl hydra-core==1.3.8 omegaconf==2.3.1 submitit hdf5plugin torchao
# omegaconf needs antlr4 4.9.*, published only as a source archive: build its (pure Python) wheel here.
python3 -m pip wheel -q --no-deps -w .whl 'antlr4-python3-runtime==4.9.3'
ls .whl
