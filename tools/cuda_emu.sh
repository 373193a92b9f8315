#!/usr/bin/env bash
# Run the CUDA backend's own sources (csrc/backend/cuda/*.cu: kernels, launch
# configurations, streams, events, the optimizer's device-resident norms) on a
# machine without a GPU, against a host emulation of the CUDA runtime and cuBLAS
# (tests/cuda_emu), and run tests/gpu/test_gpu.py against the result.
#
# How: tests/cuda_emu/rewrite_launches.py turns each `kernel<<<...>>>(...)` into a
# call of the emulator's launcher; the sources then compile with g++ against
# tests/cuda_emu/cuda_runtime.h and cublas_v2.h (not the toolkit's), with
# -ffp-contract=off (nvcc's --fmad=false) and UBSan (misaligned float4/uint4
# accesses, out-of-range shifts, overflow abort the run). The library is loaded
# in place of ctrainstate/_cuda_backend*.so through CTRAINSTATE_CUDA_BACKEND.
#
# Streams are queues. By default queued work runs as late as the program allows
# (when the host or another stream waits for it), so a missing event wait or
# stream synchronisation reads stale memory and fails a test; one run uses the
# opposite schedule (CT_EMU_SCHEDULE=eager: everything runs when issued).
#
# What this checks that tools/mock_gpu.sh cannot: the kernels' indexing and
# reductions, __syncthreads reached by every thread of a block, launch limits,
# the rules of the runtime API (a kernel launched into a stream of the current
# device, events recorded on their own device's stream, copy kinds that match
# where pointers live, frees of live allocations, cuBLAS handles used on their
# device, leading dimensions), and the ordering between streams and the host.
# What it cannot check: two streams truly running at once (one schedule at a
# time), the device's own float rounding of libm calls, performance, a real
# NCCL (its calls are emulated, with NCCL's rules: one rank per GPU, calls
# grouped, every rank in every collective; across processes too, through shared
# memory: the mpi_gpu2 run, under mpirun).
#
#   bash tools/cuda_emu.sh [pytest args...]      build, self-test, then every run below
#
#   CT_EMU_KEEP=DIR   keep the build in DIR; a later call reuses it (no rebuild, no self-test)
#                     while no file under csrc/, tests/cuda_emu/ or this script is newer
#   CT_EMU_RUNS=...   only these runs, in this order (default: all, the order below):
#                     split1 split4 eager cpu8 scan8 examples8 ngpu2_split1 ngpu2_split2 mpi_gpu2 bench;
#                     "none" builds and self-tests only. .ci/run builds once (CT_EMU_KEEP, "none")
#                     and then runs each run as its own stage, two at a time on its two cores.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${CT_EMU_KEEP:-}" ]; then
    work=$CT_EMU_KEEP
    mkdir -p "$work"
else
    work=$(mktemp -d /tmp/ctrainstate-cudaemu.XXXXXX)
    trap 'rm -rf "$work"' EXIT
fi
cd "$root"
lib="$work/cuda_backend_emu.so"
if [ -f "$lib" ] && [ -z "$(find csrc tests/cuda_emu tools/cuda_emu.sh -newer "$lib" -print -quit)" ]; then
    echo "-- reusing the emulated build in $work (built and self-tested from these sources)"
else
    rm -f "$lib"  # linked last, after the self-test passed: its presence means a good build
    mkdir -p "$work/backend"
    for src in csrc/backend/cuda/*.cu; do
        python3 tests/cuda_emu/rewrite_launches.py "$src" "$work/backend/$(basename "$src" .cu).cpp"
    done
    python3 tests/cuda_emu/rewrite_launches.py tests/cuda_emu/selftest.cu "$work/selftest.cpp"
    flags=(-std=c++17 -O1 -g1 -fPIC -ffp-contract=off -fno-omit-frame-pointer
           -fsanitize=undefined -fno-sanitize-recover=undefined
           -Wall -Wextra -Werror -Wno-unused-parameter -Wno-unused-function -Wno-unknown-pragmas
           -I tests/cuda_emu -iquote csrc/backend/cuda -I csrc)
    objs=()
    pids=()
    for cpp in "$work"/backend/*.cpp tests/cuda_emu/cuda_emu.cpp "$work/selftest.cpp"; do
        obj="$work/$(basename "$cpp" .cpp).o"
        ${CXX:-g++} "${flags[@]}" -c "$cpp" -o "$obj" &
        pids+=($!)
        objs+=("$obj")
    done
    for p in "${pids[@]}"; do wait "$p"; done
    ${CXX:-g++} -fsanitize=undefined -o "$work/selftest" "$work/selftest.o" "$work/cuda_emu.o"
    echo "-- the emulation's own checks (tests/cuda_emu/selftest.cu)"
    if ! CT_EMU_NGPU=2 "$work/selftest" 2> "$work/selftest.log"; then
        cat "$work/selftest.log" >&2  # the expected rule violations, then the failed checks
        exit 1
    fi
    backend_objs=()
    for o in "${objs[@]}"; do [ "$(basename "$o")" = selftest.o ] || backend_objs+=("$o"); done
    ${CXX:-g++} -shared -fsanitize=undefined -o "$work/cuda_backend_emu.so" "${backend_objs[@]}"
fi
export CTRAINSTATE_CUDA_BACKEND="$work/cuda_backend_emu.so"
export CTRAINSTATE_NCCL_LIB="$work/cuda_backend_emu.so"  # it also emulates the NCCL calls
pt=(python -m pytest -q -p no:cacheprovider)
# Tests whose behaviour does not depend on the device layout run in full in the split4 run
# only (and in examples8 / ngpu2_split2 for the examples): the other layouts leave them out.
# test_fused_launch_settings_give_the_same_bits uses the first device alone (the kernels'
# launch settings, one device's schedule); the examples are whole training runs, kept where
# their collectives differ (4 and 8 logical devices of one GPU; two GPUs with NCCL between).
once=(--deselect tests/gpu/test_gpu.py::test_fused_launch_settings_give_the_same_bits)
examples=(--deselect tests/gpu/test_gpu.py::test_example_runs_on_gpu_devices)

run() {  # run NAME [pytest args...]
    local name=$1
    shift
    case $name in
    split4)
        echo "-- tests/gpu/test_gpu.py on the CUDA sources under emulation, CTRAINSTATE_GPU_SPLIT=4"
        CTRAINSTATE_GPU_SPLIT=4 "${pt[@]}" tests/gpu/test_gpu.py "$@" ;;
    split1)
        echo "-- the same with CTRAINSTATE_GPU_SPLIT=1 (without the launch-settings case and the examples)"
        CTRAINSTATE_GPU_SPLIT=1 "${pt[@]}" tests/gpu/test_gpu.py "${once[@]}" "${examples[@]}" "$@" ;;
    eager)
        echo "-- split 4, every queued operation run when issued (CT_EMU_SCHEDULE=eager; without the"
        echo "   launch-settings case and the examples)"
        CT_EMU_SCHEDULE=eager CTRAINSTATE_GPU_SPLIT=4 "${pt[@]}" tests/gpu/test_gpu.py "${once[@]}" \
            "${examples[@]}" "$@" ;;
    cpu8)
        echo "-- CPU suites that are device-generic, on 8 emulated GPU devices (the default backend)"
        CTRAINSTATE_GPU_SPLIT=8 "${pt[@]}" tests/ops/test_ops.py \
            tests/nn/test_modules.py tests/optim/test_optim_combine.py tests/train_state/test_train_state.py \
            tests/ops/test_softmax.py tests/ops/test_nan_and_ties.py tests/array/test_take_rows.py tests/autodiff/test_remat.py tests/array/test_slicing.py \
            tests/ops/test_argmax_categorical.py tests/nn/test_attention.py tests/ops/test_matmul_precision.py \
            tests/array/test_slicing_advanced.py tests/ops/test_mixed_precision.py tests/ops/test_int_bool_ops.py \
            tests/ops/test_float_ops.py tests/nn/test_activation.py tests/ops/test_linalg.py \
            tests/array/test_move_ops.py tests/optim/test_optim_lowp.py tests/ops/test_sort.py \
            tests/ops/test_numpy_math.py tests/autodiff/test_pmap.py tests/autodiff/test_vmap.py tests/ops/test_lax.py \
            tests/ops/test_conv_local.py tests/nn/test_recurrent.py tests/nn/test_linen.py \
            tests/random/test_random_dist.py tests/ops/test_numpy_more.py tests/autodiff/test_custom_vjp.py \
            tests/optim/test_optim_alias.py ;;
    scan8)
        # scan/vmap: without its live-flax parity cases (jax's compiles take most of that file's time;
        # the cases left compare meshes with one device, scan over remat, the reference's P9/P11)
        echo "-- tests/nn/test_scan_vmap.py on 8 emulated GPU devices, without its live-flax cases"
        CTRAINSTATE_GPU_SPLIT=8 "${pt[@]}" tests/nn/test_scan_vmap.py -k "not match" ;;
    examples8)
        echo "-- the examples on 8 logical devices of one emulated GPU (CTRAINSTATE_GPU_SPLIT=8)"
        CTRAINSTATE_GPU_SPLIT=8 "${pt[@]}" tests/gpu/test_gpu.py -k example "$@" ;;
    ngpu2_split1|ngpu2_split2)
        local skip=("${once[@]}")
        [ "$name" = ngpu2_split2 ] || skip+=("${examples[@]}")
        echo "-- two emulated GPUs, NCCL between them (CT_EMU_NGPU=2, CTRAINSTATE_GPU_SPLIT=${name#ngpu2_split};"
        echo "   without the launch-settings case${skip[2]:+ and the examples})"
        CT_EMU_NGPU=2 CTRAINSTATE_GPU_SPLIT=${name#ngpu2_split} "${pt[@]}" tests/gpu/test_gpu.py "${skip[@]}" "$@" ;;
    mpi_gpu2)
        # two processes, one emulated GPU each: all-reduces across processes through NCCL
        # communicators across processes (the emulation's ranks meet in shared memory), against
        # the host path in the same job (tests/mpi/gpu_nccl.py)
        if ! command -v mpirun > /dev/null; then
            echo "-- mpi_gpu2 skipped: mpirun not found (install Open MPI: apt-get install openmpi-bin)"
            return 0
        fi
        # (and the fused optimizer's reductions across processes, against the CPU devices);
        # then two emulated GPUs per process, two logical devices each (four NCCL ranks)
        echo "-- two processes (mpirun -n 2), one emulated GPU each, NCCL across processes"
        (cd tests/mpi && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \
            CTRAINSTATE_NUM_CPU_DEVICES=1 CT_EMU_NGPU=1 CTRAINSTATE_GPU_SPLIT=1 CT_EMU_NCCL_TIMEOUT=60 \
            PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
            timeout 120 mpirun -n 2 --oversubscribe python gpu_nccl.py)
        echo "-- two processes, two emulated GPUs each split in two (CT_EMU_NGPU=2, CTRAINSTATE_GPU_SPLIT=2)"
        (cd tests/mpi && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \
            CTRAINSTATE_NUM_CPU_DEVICES=4 CT_EMU_NGPU=2 CTRAINSTATE_GPU_SPLIT=2 CT_EMU_NCCL_TIMEOUT=60 \
            PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
            timeout 120 mpirun -n 2 --oversubscribe python gpu_nccl.py) ;;
    bench)
        echo "-- the GPU benchmarks of benchmarks/gpu_check.sh at toy sizes (that they run; times mean nothing here)"
        PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" bench ;;
    none) ;;
    *)
        echo "cuda_emu.sh: unknown run '$name' (CT_EMU_RUNS)" >&2
        return 2 ;;
    esac
}

bench() {
    python benchmarks/bench_optim.py --gpu --reps 1 --gpu-steps 1 --gpu-flat-log2 12 --gpu-copy-log2 14 \
        --skip-tree | tail -n 3
    python benchmarks/bench_init.py --gpu --n 2**14 --reps 1 | tail -n 2
    CTRAINSTATE_GPU_SPLIT=8 python benchmarks/bench_siren.py --gpu --size 8 --hidden 16 --layers 2 \
        --steps 3 | tail -n 4
}

for name in ${CT_EMU_RUNS:-split1 split4 eager cpu8 scan8 examples8 ngpu2_split1 ngpu2_split2 mpi_gpu2 bench}; do
    run "$name" "$@"
done
