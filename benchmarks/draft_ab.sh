#!/usr/bin/env bash
# A/B of SPECGRAPH_DRAFT_EXPERIMENTS on the H200 (one device call, ~9 minutes): the draft top-k kernel
# against torch.topk and trees.top_k, its GPU tests, then whole SmolLM2-shape EAGLE-2 (64-node) steps
# profiled with no experiment, with topk, and with topk and fuse_projections, and a 64-node verify-only
# step for the draft's share (a chain's top 1 is a max either way). Logs and JSON in DIR.
#
#   bash benchmarks/draft_ab.sh [DIR]
set -uo pipefail
dir=${1:-draft-ab}
mkdir -p "$dir"
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  echo "== $name rc=$? $(tail -n 3 "$dir/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
run tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py tests/test_graphed.py \
  -k "topk or recorded_step"
run topk 120 python3 benchmarks/kernels.py --topk --out "$dir"
grep "^# topk" "$dir/topk.log"
for mode in none topk topk,fuse_projections; do  # the first also profiles the verify-only step
  sections="profile_draft"; [ "$mode" = none ] && sections="profile_verify profile_draft"
  run "e2e-$mode" 240 env SPECGRAPH_DRAFT_EXPERIMENTS=${mode#none} python3 benchmarks/e2e.py --shape smollm2 \
    --sections $sections --profile-verify-n 64 --profile-draft-trees dynamic:8,8,64 --out "$dir/$mode"
done
python3 - "$dir" <<'PY'
import json, sys
from pathlib import Path
verify = {}
for mode in ("none", "topk", "topk,fuse_projections"):
    for path in sorted(Path(sys.argv[1], mode).glob("e2e-*.json")):
        res = json.loads(path.read_text())
        verify = res.get("profile_verify", {}).get("n64", verify)
        for tree, prof in res.get("profile_draft", {}).items():
            draft = prof["device_ms"] - verify.get("device_ms", float("nan"))
            print(f"{mode:22s} {tree:16s} device {prof['device_ms']:.3f} ms  wall {prof['wall_ms']:.3f} ms  "
                  f"draft {draft:.3f} ms (the step less verify's {verify.get('device_ms', float('nan')):.3f})")
PY
