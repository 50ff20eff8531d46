#!/usr/bin/env bash
# One call on a lent CUDA machine (the device tool): the CUDA tests, then each GPU benchmark,
# every log and JSON under $OUT. Each step has its own time limit so that one hang cannot eat
# the whole lease; a step that fails is reported and the next one still runs.
#   run: bash benchmarks/gpu/run_all.sh        (carry .whl: the wheels the image lacks)
# The H200 image (Python 3.12) lacks these of kvtier's dependencies; fetch them here, once, into
# .whl (ignored through .git/info/exclude) with pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 (and _2_17, _2_28):
#   pydantic pydantic_core annotated-types typing-inspection typing_extensions lz4
#   fastapi starlette uvicorn opentelemetry-api   (fastapi >= 0.16x imports opentelemetry)
#   redis pyzmq httptools   (kvtier imports the first two as it loads the store)
# at the versions of this machine's venv (`pip list`), with --platform manylinux_2_28_x86_64
# manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 (6.5 MiB in
# all, 2026-12-04). Without httptools there, the sidecar runs uvicorn's h11 protocol
# (kvtier/service/protocol.py). The H200 image has msgpack, xxhash, pyyaml, httpx, numpy,
# prometheus-client, uvloop and pytest already.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"

status=0
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)"
    local started=$SECONDS
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - started)) s" | tee -a "$OUT/gpu.txt"
    [ "$rc" -eq 0 ] || status=1
}

# every test module that has CUDA-marked tests
mapfile -t gpu_tests < <(grep -l "mark.gpu" tests/test_*.py)
step tests_gpu "${TESTS_LIMIT:-150}" python3 -m pytest -p no:cacheprovider -m gpu -q "${gpu_tests[@]}"
step bench_kernels "${KERNELS_LIMIT:-200}" python3 benchmarks/gpu/bench_kernels.py
step bench_mover_gpu "${MOVER_LIMIT:-200}" python3 benchmarks/gpu/bench_mover_gpu.py
step bench_dequant "${DEQUANT_LIMIT:-120}" python3 benchmarks/gpu/bench_dequant.py
step bench_datapath_gpu "${DATAPATH_LIMIT:-150}" python3 benchmarks/gpu/bench_datapath_gpu.py
exit $status
