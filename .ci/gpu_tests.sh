#!/usr/bin/env bash
# The GPU test suite in six parallel groups (one GPU, ~4 minutes on an H200 instead of ~12 in one
# process): the kernels against their references, the attention kernels, the recorded / graphed
# steps, the compiled steps through generate (a group of their own: with the recorded steps they took 12
# minutes on an H100, the longest group), seeded sampling and block verification, and the CPU-oracle tests of the folds on the GPU
# machine (not the real-model one: the model package is not there). Logs in DIR, a summary line each.
#
#   bash .ci/gpu_tests.sh [DIR] [SECONDS_PER_GROUP] [parallel|sequential] [GROUP ...]   (from the repository root)
# sequential: one group after another (a shared machine under load timed two groups out in parallel);
# GROUPs (kernels attention graphed generate folds sampling; default all) split a sequential run over device calls.
set -uo pipefail
dir=${1:-gpu-tests}
limit=${2:-600}
mode=${3:-parallel}
shift $(( $# < 3 ? $# : 3 ))
only=" ${*:-kernels attention graphed generate folds sampling} "
mkdir -p "$dir"
group() {
  local name=$1; shift
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$dir/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$dir/$name.log")"
}
bg() {  # bg group NAME ARGS...: run it now (sequential), in the background (parallel), or not (not chosen)
  [[ "$only" == *" $2 "* ]] || return 0
  if [ "$mode" = sequential ]; then "$@"; else "$@" & fi
}
bg group kernels tests/kernels/test_kernels_gpu.py tests/kernels/test_fused_linear.py tests/kernels/test_kv_write.py \
  tests/kernels/test_compact_kv.py tests/kernels/test_topk.py
bg group attention tests/kernels/test_tree_attention.py tests/kernels/test_tree_attention_write.py
bg group graphed tests/test_graphed.py tests/test_gpu.py tests/test_capture_gpu.py
bg group generate tests/test_generate_gpu.py
bg group folds -m "not model" tests/test_fold_norms.py tests/test_fold_rotary.py tests/test_fuse_projections.py
bg group sampling tests/test_sampling_gpu.py
wait
grep -h "^FAILED" "$dir"/*.log || true
