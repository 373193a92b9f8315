#!/usr/bin/env bash
# Run tests/gpu/test_gpu.py (and tests/checkpoint/test_checkpoint.py's GPU test) on machines without a GPU,
# against a host emulation of the CUDA backend (tests/mock_gpu/mock_backend.cpp) loaded in place of
# ctrainstate/_cuda_backend*.so through CTRAINSTATE_CUDA_BACKEND.
#
# What this checks: the core's and the Python layer's GPU code paths (device
# registration, CTRAINSTATE_GPU_SPLIT logical devices, host<->device copies and
# resharding, op dispatch, the GPU optimizer step sequencing of
# csrc/core/ct_optim_device.c, the PRNG block geometry, DLPack), with the
# per-element math of the shared headers (ct_optim_math.h, ct_random_math.h,
# ct_ops_math.h) the CUDA kernels use. "Device" pointers are offset to
# non-canonical addresses, so any host dereference of device memory outside the
# emulation crashes. What it does not check: the CUDA kernels themselves, streams
# running concurrently, cuBLAS, NCCL: those need benchmarks/gpu_check.sh on a GPU.
#
#   bash tools/mock_gpu.sh [pytest args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ctrainstate-mockgpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$root"
${CXX:-g++} -std=c++17 -O1 -g1 -fPIC -shared -Wall -Wextra -Werror -I csrc \
    -o "$work/mock_backend.so" tests/mock_gpu/mock_backend.cpp
export CTRAINSTATE_CUDA_BACKEND="$work/mock_backend.so"
# Logical devices sharing a GPU, and two physical GPUs: the layouts whose host-side paths
# differ most. One unsplit GPU and the examples on 8 logical devices run on the CUDA sources
# themselves in tools/cuda_emu.sh (its split1 and examples8 runs).
echo "-- tests/gpu/test_gpu.py on the emulated backend, CTRAINSTATE_GPU_SPLIT=4"
CTRAINSTATE_GPU_SPLIT=4 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py "$@"
echo "-- two emulated physical GPUs (MOCK_NGPU=2)"
MOCK_NGPU=2 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py "$@"
echo "-- checkpoints saved from and restored onto emulated GPU devices, CTRAINSTATE_GPU_SPLIT=4"
CTRAINSTATE_GPU_SPLIT=4 python -m pytest -q -p no:cacheprovider -m gpu tests/checkpoint/test_checkpoint.py "$@"
