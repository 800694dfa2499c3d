#!/bin/bash
# Every check that needs a CUDA GPU, in one go (a lent GPU machine is short of time):
#   bash bench/device_all.sh [--suite]  # logs under $OUT, or a new temporary folder
# 1. the CUDA tests (tests/test_cuda.py and the CUDA test of test_torchrun.py);
# 2. bench/device_check.py on the small workload (5 pairs) and the large one (3 pairs), each
#    also with --no-segments (stat-child only) for the A/B of batched device statistics;
# 3. with --suite, the whole test suite on that machine's torch and transformers, 8 workers
#    (tests of the `atb-probe` command and of the tools extra fail where those are missing).
# Runs from the repository root with the python that has torch (PYTHON, default python3); the
# package is taken from src/, so nothing is installed.
set -o pipefail
out=${OUT:-$(mktemp -d)}
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
"$py" -c 'import sys, torch, transformers, numpy; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())'
echo "== CUDA tests"
timeout 240 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
    tests/test_torchrun.py::test_cuda_process_takes_the_index_of_its_tensors_over_local_rank \
    2>&1 | tee "$out/cuda_tests.log"
check() {  # log name, device_check arguments
    local log=$1
    shift
    echo "== device_check $*"
    timeout 180 "$py" bench/device_check.py "$@" 2>&1 | grep -v "^Ready to dump" \
        | tee "$out/$log.log"
}
check small --pairs 5
check small_nosegments --pairs 5 --cases stat-child --no-segments
check large --workload large --pairs 3
check large_nosegments --workload large --pairs 3 --cases stat-child --no-segments
if [ "${1:-}" = "--suite" ]; then
    echo "== whole suite"
    timeout 200 "$py" -m pytest -q -p no:cacheprovider -n 8 tests > "$out/suite.log" 2>&1
    echo "suite exit $?"
    tail -25 "$out/suite.log"
fi
