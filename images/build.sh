#!/bin/sh
# Build a memsifter image from a minimal context (no .venv, no caches):
#   images/build.sh FAMILY [TAG] [docker build args...]
#   images/build.sh chat ghcr.io/memsifter/memsifter-chat:0.1.0 --build-arg BASE_IMAGE=local/debian-python:bookworm
# Families: the directories of images/ that hold a Dockerfile, except base (chat is also the driver image).
# Two builds: images/base/Dockerfile first (the layer cache makes it quick when nothing changed), on the Ray image
# whose tag the family names (ARG MEMSIFTER_BASE=memsifter-base:<Ray tag>, the Ray repository is the base's), then
# the family file on that base. The docker build args go to both; BASE_IMAGE=... replaces the base's Ray image.
# The base is tagged memsifter-base:<Ray tag> (memsifter-base:<BASE_IMAGE, sanitized> when BASE_IMAGE is given),
# or $MEMSIFTER_BASE_TAG.
set -eu
usage="usage: images/build.sh FAMILY [TAG] [docker build args...]"
family=${1:?$usage}
shift
tag=${1:-memsifter-$family:dev}
[ $# -gt 0 ] && shift
root=$(cd "$(dirname "$0")/.." && pwd)
dockerfile=images/$family/Dockerfile
if [ "$family" = base ] || [ ! -f "$root/$dockerfile" ]; then
  echo "no family image $dockerfile (images/base is built with each family)" >&2
  exit 2
fi
ray_tag=$(sed -n 's/^ARG MEMSIFTER_BASE=[^:]*:\([^[:space:]]*\).*/\1/p' "$root/$dockerfile")
ray_repo=$(sed -n 's/^ARG BASE_IMAGE=\([^:[:space:]]*\):.*/\1/p' "$root/images/base/Dockerfile")
[ -n "$ray_tag" ] && [ -n "$ray_repo" ] || { echo "$dockerfile: no ARG MEMSIFTER_BASE=memsifter-base:<Ray tag>" >&2; exit 2; }
base_image=$ray_repo:$ray_tag
base_tag=memsifter-base:$ray_tag
prev=""
for arg in "$@"; do  # a BASE_IMAGE given as a build arg names the base after it
  case "$prev $arg" in
    "--build-arg BASE_IMAGE="* | *" --build-arg=BASE_IMAGE="*)
      base_image=${arg#*BASE_IMAGE=}
      base_tag=memsifter-base:$(printf %s "$base_image" | tr -c 'A-Za-z0-9_.-' '-' | cut -c1-120) ;;
  esac
  prev=$arg
done
base_tag=${MEMSIFTER_BASE_TAG:-$base_tag}
sha=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo "")
cd "$root"
files="pyproject.toml requirements/constraints.txt images memsifter"
[ -f README.md ] && files="$files README.md"
context=$(mktemp)
trap 'rm -f "$context"' EXIT
# shellcheck disable=SC2086
tar -c --exclude='__pycache__' --exclude='*.pyc' $files > "$context"
docker build -f images/base/Dockerfile -t "$base_tag" --build-arg "BASE_IMAGE=$base_image" \
  --build-arg "MEMSIFTER_GIT_SHA=$sha" "$@" - < "$context"
# the family file copies nothing: it is sent on its own, without a context
docker build -t "$tag" --build-arg "MEMSIFTER_BASE=$base_tag" "$@" - < "$dockerfile"
