#!/usr/bin/env bash
# Build and tag both weightcache images for a registry (and optionally push them).
#
#   scripts/build-images.sh --registry registry.example.com/ml --tag 0.1.0 [--push]
#   make images REGISTRY=registry.example.com/ml TAG=0.1.0 [PUSH=1]
#
# Images (the names the chart expects under `imageRegistry`):
#   REGISTRY/weightcache/operator:TAG   Dockerfile.operator (no torch)
#   REGISTRY/weightcache/agent:TAG      Dockerfile.agent --target native; CPU torch by default,
#                                       --gpu: CUDA torch + cuda-python (EXTRAS=native,cuda)
#   REGISTRY/weightcache/agent-vllm:VLLM_TAG   only with --vllm-image IMAGE (target vllm)
# Options may also come from the environment: REGISTRY, TAG, PUSH=1, GPU=1, VLLM_IMAGE,
# TORCH_INDEX_URL, BUILDER (docker, podman or buildah; default: the first one found).
# --dry-run prints the commands instead of running them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REGISTRY=${REGISTRY:-}
TAG=${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/weightcache/Chart.yaml")}
PUSH=${PUSH:-0}
GPU=${GPU:-0}
VLLM_IMAGE=${VLLM_IMAGE:-}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
BUILDER=${BUILDER:-}
DRY_RUN=0

usage() {
  sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

die() {
  echo "build-images: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --registry) [ $# -ge 2 ] || die "--registry needs a value"; REGISTRY=$2; shift 2 ;;
    --tag) [ $# -ge 2 ] || die "--tag needs a value"; TAG=$2; shift 2 ;;
    --push) PUSH=1; shift ;;
    --gpu) GPU=1; shift ;;
    --vllm-image) [ $# -ge 2 ] || die "--vllm-image needs a value"; VLLM_IMAGE=$2; shift 2 ;;
    --builder) [ $# -ge 2 ] || die "--builder needs a value"; BUILDER=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

[ -n "$TAG" ] || die "no --tag and no appVersion in charts/weightcache/Chart.yaml"
case "$TAG" in
  *[!A-Za-z0-9_.-]*|[.-]*) die "--tag $TAG is not a valid image tag ([A-Za-z0-9_][A-Za-z0-9_.-]*)" ;;
esac
if [ "$PUSH" = 1 ] && [ -z "$REGISTRY" ]; then
  die "--push needs --registry (where to push)"
fi

if [ -z "$BUILDER" ]; then
  for candidate in docker podman buildah; do
    if command -v "$candidate" >/dev/null 2>&1; then BUILDER=$candidate; break; fi
  done
fi
if [ -z "$BUILDER" ]; then
  [ "$DRY_RUN" = 1 ] || die "no image builder found: install docker, podman or buildah (or set BUILDER)"
  BUILDER=docker
fi
case "$BUILDER" in
  docker|podman) BUILD=("$BUILDER" build) ;;
  buildah) BUILD=(buildah bud) ;;
  *) die "BUILDER must be docker, podman or buildah, not $BUILDER" ;;
esac

prefix=${REGISTRY%/}
prefix=${prefix:+$prefix/}
OPERATOR="${prefix}weightcache/operator:${TAG}"
AGENT="${prefix}weightcache/agent:${TAG}"

run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

cd "$ROOT"
run "${BUILD[@]}" -f Dockerfile.operator --target operator -t "$OPERATOR" .
if [ "$GPU" = 1 ]; then
  run "${BUILD[@]}" -f Dockerfile.agent --target native --build-arg EXTRAS=native,cuda -t "$AGENT" .
else
  run "${BUILD[@]}" -f Dockerfile.agent --target native \
    --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" -t "$AGENT" .
fi
IMAGES=("$OPERATOR" "$AGENT")
if [ -n "$VLLM_IMAGE" ]; then
  vllm_tag=${VLLM_IMAGE##*:}
  [ "$vllm_tag" != "$VLLM_IMAGE" ] || die "--vllm-image $VLLM_IMAGE needs an explicit tag (e.g. :v0.33.0)"
  VLLM_AGENT="${prefix}weightcache/agent-vllm:${vllm_tag}"
  run "${BUILD[@]}" -f Dockerfile.agent --target vllm --build-arg "VLLM_IMAGE=$VLLM_IMAGE" \
    -t "$VLLM_AGENT" .
  IMAGES+=("$VLLM_AGENT")
fi
if [ "$PUSH" = 1 ]; then
  for image in "${IMAGES[@]}"; do
    run "$BUILDER" push "$image"
  done
fi

chart_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/weightcache/Chart.yaml")
echo "images: ${IMAGES[*]}" >&2
if [ -n "$REGISTRY" ]; then
  tag_args=""
  if [ "$TAG" != "$chart_version" ]; then
    tag_args=" --set operator.image.tag=$TAG --set agent.image.tag=$TAG"
  fi
  echo "install: helm install weightcache charts/weightcache -n weightcache-system --create-namespace --set imageRegistry=${REGISTRY%/}${tag_args}" >&2
fi
