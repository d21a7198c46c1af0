# Sourced by the A/B scripts (draft_ab.sh, rows_ab.sh) after they set default_dir and default_steps:
# DIR and STEP... from the script's arguments, and run NAME SECONDS CMD... logging to DIR/NAME.log.
set -uo pipefail
dir=${1:-$default_dir}
shift || true
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=("${default_steps[@]}")
mkdir -p "$dir"
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  echo "== $name rc=$? $(tail -n 3 "$dir/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
