#!/bin/sh
# The one install step of a family image (images/<family>/Dockerfile), run as root on the base image:
#   RUN sh /src/images/install.sh [-o OVERRIDES] [-b BUILD_SPEC] SPEC...
# SPECs are pip requirement specs, memsifter itself as "/src[extras]". The pins are requirements/constraints.txt
# with those of OVERRIDES (a file of images/, e.g. gpu-overrides.txt) in their place; the effective set stays in
# the image as /opt/memsifter/constraints.txt. BUILD_SPEC (e.g. flash-attn) is built from source after the SPECs,
# against the torch they installed (no build isolation), then checked by importing it. Removes /src afterwards and
# checks that memsifter and ray start.
set -eu
overrides=""
build=""
while [ $# -gt 0 ]; do
  case $1 in
    -o) overrides=/src/images/${2:?-o needs a file of images/}; shift 2 ;;
    -b) build=${2:?-b needs a requirement spec}; shift 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: install.sh [-o OVERRIDES] [-b BUILD_SPEC] SPEC..." >&2; exit 2; }
# shellcheck disable=SC2086
python3 /src/images/constraints.py /src/requirements/constraints.txt $overrides > /opt/memsifter/constraints.txt
pip install -c /opt/memsifter/constraints.txt "$@"
if [ -n "$build" ]; then
  pip install -c /opt/memsifter/constraints.txt --no-build-isolation --no-deps "$build"
  python3 -c "import importlib, sys; importlib.import_module(sys.argv[1])" "$(printf %s "$build" | sed 's/[=<>!~ ].*//; s/-/_/g')"
fi
rm -rf /src
memsifter --version
ray --version
