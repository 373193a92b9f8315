#!/usr/bin/env bash
# Build ctrainstate._C with AddressSanitizer + UBSan into a scratch directory and
# run the test suite against that build (jax/flax parity tests are skipped: they
# do not need our C code and jaxlib is not built for ASan).
#
#   bash tools/sanitize.sh [pytest args...]
#
# CT_SANITIZE_PYTHON=PATH runs the tests with that interpreter (the build uses `python`): CI
# runs them in the venv with the oldest numpy / ml_dtypes / scipy that pyproject.toml allows,
# so one sanitized run also checks those floors.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ctrainstate-asan.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$root"
mkdir -p "$work/python"
# the package without __pycache__: another stage of .ci/run may be writing .pyc files there
tar -C python --exclude=__pycache__ -cf - ctrainstate | tar -C "$work/python" -xf -
rm -f "$work"/python/ctrainstate/_C*.so
CTRAINSTATE_NO_CUDA=1 CTRAINSTATE_SANITIZE=1 CTRAINSTATE_WERROR=1 python setup.py -q build_ext \
    --build-lib "$work/python" --build-temp "$work/tmp" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$asan:$ubsan"
# allocator_may_return_null: a request beyond what ASan's allocator serves (numpy asked for
# terabytes by a test of a size check, tests/meta/test_bindings_fuzz.py) returns NULL, which numpy
# raises as MemoryError, as the plain build does, instead of aborting the process
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$work/python${PYTHONPATH:+:$PYTHONPATH}"
export CTRAINSTATE_SANITIZED=1
py=${CT_SANITIZE_PYTHON:-python}
"$py" -c "import ctrainstate, sys; assert ctrainstate.__file__.startswith('$work'), ctrainstate.__file__; print('sanitized build:', ctrainstate._C.__file__)"
"$py" -m pytest -x -q -p no:cacheprovider "$@" tests
