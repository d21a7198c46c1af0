# What the investigation scripts share (sourced, not run): DIR and STEP... from the script's arguments, with
# the script's defaults, and run NAME SECONDS CMD..., which logs to DIR/NAME.log and prints its end.
#   source "$(dirname "$0")/steps.sh" DEFAULT_DIR "DEFAULT_STEP ..." "$@"
set -uo pipefail
default_dir=$1
read -r -a default_steps <<< "$2"
shift 2
dir=${1:-$default_dir}
shift || true
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=("${default_steps[@]}")
mkdir -p "$dir"
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  echo "== $name rc=$? $(tail -n 3 "$dir/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
