#!/usr/bin/env bash
# Several detached GPU runs side by side on one multi-GPU host, each on its own GPUs with its own Ray (its own
# RAY_TMPDIR: `ray.init` finds a running cluster through an address file there) and work folder, started,
# polled and collected by the one detached-run helper (memsifter/runs/detached.py). A run is a line of LAYOUT:
#   NAME  DETACHED_CONFIG  GPUS  [ARGS after --]
#   bash benchmarks/gpu/side_by_side.sh start LAYOUT      # after `source benchmarks/gpu/install.sh`
#   bash benchmarks/gpu/side_by_side.sh poll LAYOUT       # every run's state, one line each
#   bash benchmarks/gpu/side_by_side.sh wait LAYOUT SECONDS   # until all ended or SECONDS passed
#   bash benchmarks/gpu/side_by_side.sh collect LAYOUT "$OUT" # each run's files -> $OUT/NAME.tgz (one file a run)
set -uo pipefail
what=$1 layout=$2
py=${PYTHON:-python3}
root=${SBS_ROOT:-/root}   # where the runs' folders go
runs() { grep -v '^\s*#' "$layout" | grep -v '^\s*$'; }
sets() {  # the settings that give run NAME on GPUS its own folder, GPUs and Ray
  echo --set "work=$root/sbs-$1" --set "env.CUDA_VISIBLE_DEVICES=\"$2\"" --set "env.RAY_TMPDIR=$root/rt-$1"
}
case $what in
  start)
    runs | while read -r name cfg gpus args; do
      mkdir -p "$root/rt-$name/ray"
      # shellcheck disable=SC2046
      $py -m memsifter.runs.detached start "$cfg" $(sets "$name" "$gpus") ${args:+-- $args} && echo "started $name on GPU $gpus"
    done ;;
  poll)
    runs | while read -r name cfg gpus args; do
      $py -m memsifter.runs.detached poll "$cfg" $(sets "$name" "$gpus") | $py -c "
import json, sys, time
d = json.load(sys.stdin)
s = d.get('elapsed_s') or (d.get('ended') or time.time()) - d.get('started', time.time())
print(f\"{sys.argv[1]}: {d.get('state')} exit {d.get('rc', '-')} {s:.0f} s\")" "$name"
    done ;;
  wait)
    end=$(( $(date +%s) + ${3:-540} ))
    while [ "$(date +%s)" -lt "$end" ]; do
      left=0
      while read -r name cfg gpus args; do
        $py -m memsifter.runs.detached poll "$cfg" $(sets "$name" "$gpus") | grep -qE '"state": "(starting|running)"' && left=$((left + 1))
      done < <(runs)
      [ "$left" -eq 0 ] && break
      sleep 15
    done
    bash "$0" poll "$layout" ;;
  collect)
    out=$3
    runs | while read -r name cfg gpus args; do
      $py -m memsifter.runs.detached collect "$cfg" $(sets "$name" "$gpus") --out "$root/sbs-out/$name" >/dev/null 2>&1
      tar -C "$root/sbs-out" -czf "$out/$name.tgz" "$name" && echo "collected $name: $(du -h "$out/$name.tgz" | cut -f1)"
    done ;;
  *) echo "side_by_side.sh: start|poll|wait|collect LAYOUT" >&2; exit 2 ;;
esac
