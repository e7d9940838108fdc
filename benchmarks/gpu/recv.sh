#!/usr/bin/env bash
# On the GPU host: copy every piece found in the checkout's .gpu/ (bundle pNN, extra wheels xNN, data yNN)
# to $MEMSIFTER_GPU_STAGE (default /root/gpu-stage), checking each against its recorded sha256. Run it
# after each batch of pieces arrives (the checkout's .gpu/ can then be emptied for the next batch);
# install.sh runs it again.
set -euo pipefail
S=${MEMSIFTER_GPU_STAGE:-/root/gpu-stage}
mkdir -p "$S"
for d in .gpu/p[0-9][0-9] .gpu/x[0-9][0-9] .gpu/y[0-9][0-9]; do  # y: input data too big for one call
  [ -f "$d/piece" ] || continue
  want=$(python3 -c "import json,sys;print(json.load(open('$d/piece.json'))['sha256'])")
  got=$(sha256sum "$d/piece" | cut -d' ' -f1)
  if [ "$want" != "$got" ]; then echo "recv: $d: sha256 mismatch ($got != $want)" >&2; exit 1; fi
  cp "$d/piece" "$S/$(basename "$d")"; cp "$d/piece.json" "$S/$(basename "$d").json"
  echo "recv: $(basename "$d") ok ($(stat -c %s "$d/piece") bytes)"
done
echo "recv: staged so far: $(ls "$S" | grep -c '^p.*json$') bundle + $(ls "$S" | grep -c '^x.*json$') extra piece(s) in $S"
