#!/usr/bin/env bash
# A/B of the draft fast paths (specgraph/fast_paths.py) on the H200: the draft top-k kernel against
# torch.topk and selection.top_k, its GPU tests, then whole SmolLM2-shape EAGLE-2 (64-node) steps profiled
# with the fast paths switched off one by one (SPECGRAPH_SKIP_FAST_PATHS), and a 64-node verify-only step
# for the draft's share (a chain's top 1 is a max either way). Logs and JSON in DIR.
#
#   bash benchmarks/investigations/draft_ab.sh [DIR [STEP...]]
#
# STEP is tests, topk, or what to skip: all-on (nothing), topk, topk,fuse_projections, ... (default:
# tests topk topk,fuse_projections topk all-on). Each profile compiles its step (~2 minutes on a fresh
# machine): pass a subset to split the work over several device calls (600 s each).
source "$(dirname "$0")/steps.sh" draft-ab "tests topk topk,fuse_projections topk all-on" "$@"
for step in "${steps[@]}"; do
  case $step in
    tests) run tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py \
             tests/test_graphed.py -k "topk or (recorded_step and eagle3)" ;;
    topk) run topk 120 python3 benchmarks/kernels.py --topk --out "$dir"; grep "^# topk" "$dir/topk.log" ;;
    *) skip=${step#all-on}; name=skip-${skip//,/+}; name=${name%-}  # "skip" alone: nothing skipped
       sections="profile_draft"; [ "$skip" = topk,fuse_projections ] && sections="profile_verify profile_draft"
       run "e2e-$name" 300 env SPECGRAPH_SKIP_FAST_PATHS="$skip" python3 benchmarks/e2e.py --shape smollm2 \
         --sections $sections --profile-verify-n 64 --profile-draft-trees dynamic:8,8,64 --out "$dir/$name" ;;
  esac
done
python3 - "$dir" <<'PY'
import json, sys
from pathlib import Path
runs = sorted(Path(sys.argv[1]).glob("skip*/e2e-*.json"))
verify = {}
for path in runs:
    verify = json.loads(path.read_text()).get("profile_verify", {}).get("n64", verify)
for path in runs:
    res = json.loads(path.read_text())
    for tree, prof in res.get("profile_draft", {}).items():
        draft = prof["device_ms"] - verify.get("device_ms", float("nan"))
        print(f"skip {res.get('skip_fast_paths') or '-':22s} {tree:16s} device {prof['device_ms']:.3f} ms  "
              f"wall {prof['wall_ms']:.3f} ms  draft {draft:.3f} ms (the step less verify's "
              f"{verify.get('device_ms', float('nan')):.3f})")
PY
