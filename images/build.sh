#!/bin/sh
# Build a memsifter image from a minimal context (no .venv, no caches):
#   images/build.sh FAMILY [TAG] [docker build args...]
#   images/build.sh chat ghcr.io/memsifter/memsifter-chat:0.1.0 --build-arg BASE_IMAGE=local/debian-python:bookworm
# Families: the directories of images/ that hold a Dockerfile (chat is also the driver image).
set -eu
family=${1:?usage: images/build.sh FAMILY [TAG] [docker build args...]}
shift
tag=${1:-memsifter-$family:dev}
[ $# -gt 0 ] && shift
root=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$root/images/$family/Dockerfile" ] || { echo "no images/$family/Dockerfile" >&2; exit 2; }
sha=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo "")
cd "$root"
files="pyproject.toml requirements/constraints.txt images memsifter"
[ -f README.md ] && files="$files README.md"
# shellcheck disable=SC2086
tar -c --exclude='__pycache__' --exclude='*.pyc' $files \
  | docker build -f "images/$family/Dockerfile" -t "$tag" --build-arg "MEMSIFTER_GIT_SHA=$sha" "$@" -
