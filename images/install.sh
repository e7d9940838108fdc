#!/bin/sh
# The one install step of a family image (images/<family>/Dockerfile), run as root on the base image:
#   RUN sh /src/images/install.sh [-o OVERRIDES] SPEC...
# SPECs are pip requirement specs, memsifter itself as "/src[extras]". The pins are requirements/constraints.txt
# with those of OVERRIDES (a file of images/, e.g. gpu-overrides.txt) in their place; the effective set stays in
# the image as /opt/memsifter/constraints.txt. Removes /src afterwards and checks that memsifter and ray start.
set -eu
overrides=""
if [ "${1:-}" = "-o" ]; then
  overrides=/src/images/${2:?-o needs a file of images/}
  shift 2
fi
[ $# -gt 0 ] || { echo "usage: install.sh [-o OVERRIDES] SPEC..." >&2; exit 2; }
# shellcheck disable=SC2086
python3 /src/images/constraints.py /src/requirements/constraints.txt $overrides > /opt/memsifter/constraints.txt
pip install -c /opt/memsifter/constraints.txt "$@"
rm -rf /src
memsifter --version
ray --version
