#!/usr/bin/env bash
# A/B of fold_norms_rows past 16 rows on the H200 (fused_linear's 32/64-row tiles): their GPU tests, the
# product sweep at 64 rows, then the SmolLM2-shape 64-node verify step and EAGLE-2 DynamicTree(8, 8, 64)
# step profiled with the fold's limit at 16 (the default) and at 64 (SPECGRAPH_FOLD_NORMS_ROWS=64).
# Logs and JSON in DIR.
#
#   bash benchmarks/rows_ab.sh [DIR [STEP...]]
#
# STEP is tests, sweep, rows16 or rows64 (default: tests rows16 rows64; the sweep is long). Each profile
# compiles two steps (~2-3 minutes on a fresh machine): pass a subset to split the work over device calls.
default_dir=rows-ab
default_steps=(tests rows16 rows64)
source "$(dirname "$0")/ab_common.sh"
for step in "${steps[@]}"; do
  case $step in
    tests) run tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py -k fused_linear ;;
    sweep) run sweep 500 python3 benchmarks/fused_linear.py --shapes smollm2 --rows 64 --out "$dir" ;;
    rows16|rows64)
       run "e2e-$step" 400 env SPECGRAPH_FOLD_NORMS_ROWS="${step#rows}" python3 benchmarks/e2e.py --shape smollm2 \
         --sections profile_verify profile_draft --profile-verify-n 64 --profile-draft-trees dynamic:8,8,64 \
         --out "$dir/$step" ;;
    *) echo "unknown step $step (tests, sweep, rows16, rows64)"; exit 2 ;;
  esac
done
python3 - "$dir" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("rows*/e2e-*.json")):
    res = json.loads(path.read_text())
    for section in ("profile_verify", "profile_draft"):
        for name, prof in res.get(section, {}).items():
            print(f"{path.parent.name:6s} {section:15s} {name:16s} device {prof['device_ms']:.3f} ms  "
                  f"wall {prof['wall_ms']:.3f} ms")
PY
