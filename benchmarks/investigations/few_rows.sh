#!/usr/bin/env bash
# A SmolLM2-size verify step's few rows on the H200: specgraph::fused_linear's multi-row tiles (the few-rows
# family: 512-2048 K columns a step, 1-2 stages, against DOT_TILES), tree attention's tiles and splits at
# 8-24 nodes (launch_config's 16-row tiles stop at 32 query rows a KV head: 10 nodes with SmolLM2's GQA
# group of 3), then the profile of a plain, a 16-node verify and an EAGLE-3 DynamicTree(4, 4, 16) step.
# Where the time goes today: docs/benchmarks.md, "SmolLM2: speculation end to end".
#
#   bash benchmarks/investigations/few_rows.sh [DIR [STEP...]]     STEP: products attention profile
#
# Each step fits one device call (600 s); products takes the longest (8 product forms x 36 tiles x 2 row counts),
# attention compiles every tile x warps x splits config (~2 s apiece) and prints each case when it ends.
source "$(dirname "$0")/steps.sh" few-rows "products attention profile" "$@"
for step in "${steps[@]}"; do
  case $step in
    products) run products 580 python3 benchmarks/fused_linear.py --shapes smollm2 --rows 4 16 --tiles few-rows \
                --out "$dir"; grep "^# product\|^# layers" "$dir/products.log" ;;
    attention) run attention 580 python3 benchmarks/kernels.py --decode --decode-shapes smollm2 \
                 --decode-cases 512:8 512:16 512:24 --decode-rope on --out "$dir" ;;
    profile) run profile 580 python3 benchmarks/e2e.py --shape smollm2 --prompt 512 --sections profile \
               profile_verify profile_draft --profile-verify-n 16 --profile-draft-trees dynamic:4,4,16 --out "$dir" ;;
    *) echo "unknown step $step (products, attention, profile)"; exit 2 ;;
  esac
done
