#!/bin/bash
# The GPU check, as one script for a lent GPU machine (no network there). Run it from the
# repo root on that machine; $OUT (if set) receives the logs and the benchmark JSON.
#
# Prepare here first, in the repo root (both folders are git-ignored through
# .git/info/exclude, and travel with the run's `carry`):
#   mkdir -p .whl .dev && cp "$(command -v etcd)" .dev/etcd
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq msgspec aetcd==1.0.0 protobuf
# (the machine's own Python has torch with CUDA, numpy, typer, rich, xxhash, psutil, pyyaml,
# prometheus-client, grpcio and pytest). Then run it with carry [".whl", ".dev"]:
#   bash benchmarks/gpu_check.sh
# What it runs: the CUDA tests (tests/test_gpu.py, the transport suite on a cuda:0 segment)
# and benchmarks/gpu_paths.py (direct against staged CUDA paths, with the copy ceilings).
set -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
chmod +x .dev/etcd
export PYTHONPATH=/tmp/site:$PWD KVPOOL_ETCD=$PWD/.dev/etcd PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, zmq, msgspec, aetcd; print(torch.__version__, torch.cuda.is_available())" || exit 1
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_transports.py 2>&1 | tee "$OUT/tests.log"
timeout "${BENCH_S:-240}" python3 benchmarks/gpu_paths.py --json "$OUT/gpu_paths.json" 2>&1 | tee "$OUT/bench.log"
