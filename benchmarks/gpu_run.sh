#!/usr/bin/env bash
# The GPU session's one script (issue 30; docs/gpu.md, "Running on a GPU").
#
#   OUT=out bash benchmarks/gpu_run.sh [SECONDS [GIB...]]
#
# Runs, in order: the benchmark's dry run, tests/torch/test_cuda.py, the staging tests,
# bench_gpu at the first GIB (default 8), the profile of an async save's blocked time
# (profile_gpu_async), the DeepSpeed save path (bench_gpu_deepspeed, 8 GiB), then
# bench_gpu at the other GIBs (default 32), while the time allows. Every step's output
# goes to $OUT/run.log, the figures to JSON and Markdown beside it (a lease gives back
# at most 8 files). SECONDS (default 420) bounds the whole script, so that a lease keeps
# time for a second run. Wheels in .whl/ (the device machine has no package index; carry
# them) are installed into /tmp/site first.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
budget=${1:-420}
sizes=("${@:2}")
(( ${#sizes[@]} )) || sizes=(8 32)
deadline=$(( $(date +%s) + budget ))
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__,
                                       torch.version.cuda, torch.cuda.is_available())'
  df -h "${TMPDIR:-/tmp}" | tail -1; free -g | head -2; } > "$OUT/run.log" 2>&1
cat "$OUT/run.log"

step() {  # step NAME MAX_SECONDS COMMAND...: runs it bounded by MAX_SECONDS and the deadline
    local name=$1 limit=$2 left start rc
    shift 2
    left=$(( deadline - $(date +%s) ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then
        echo "== $name: skipped, ${left}s left" | tee -a "$OUT/run.log"
        return 1
    fi
    echo "== $name (at most ${limit}s)" | tee -a "$OUT/run.log"
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/step.log" 2>&1
    rc=$?
    cat "$OUT/step.log" >> "$OUT/run.log"
    echo "== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$OUT/run.log"
    tail -n 30 "$OUT/step.log"
    rm -f "$OUT/step.log"
    return $rc
}

step dry-run 120 python3 -m benchmarks.bench_gpu --dry-run
step test-cuda 240 python3 -m pytest -q -p no:cacheprovider tests/torch/test_cuda.py
step test-staging 120 python3 -m pytest -q -p no:cacheprovider tests/torch/test_staging.py \
    tests/deepspeed/test_staging.py
bench() {
    step "bench-$1" 600 python3 -m benchmarks.bench_gpu --gib "$1" \
        --json "$OUT/gpu-$1.json" --markdown "$OUT/gpu-$1.md"
}
bench "${sizes[0]}"  # the headline figures first
step profile-async 120 python3 -m benchmarks.profile_gpu_async --gib 8
step bench-deepspeed-8 180 python3 -m benchmarks.bench_gpu_deepspeed --gib 8 \
    --json "$OUT/gpu-deepspeed-8.json"
for gib in "${sizes[@]:1}"; do
    bench "$gib"
done
exit 0
