#!/usr/bin/env bash
# End-to-end suite on a local kind cluster: build the images, load them into kind,
# `helm install`, then run the pytest suite in e2e/ against the cluster.
#
#   e2e/run.sh                 # needs a Docker engine and kind; helm/kubectl come from make tools
#   KEEP_CLUSTER=1 e2e/run.sh  # leave the cluster running afterwards
#   TORCH_INDEX_URL=<PyTorch CPU wheel index> e2e/run.sh   # smaller agent image
#
# Without a Docker engine or kind it prints why and exits 0 (E2E_REQUIRED=1: exits 1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

CLUSTER=${WEIGHTCACHE_E2E_CLUSTER:-weightcache-e2e}
TAG=e2e
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
export PATH="$ROOT/.venv/tools:$PATH"

skip() {
  echo "e2e: SKIPPED: $*" >&2
  if [ "${E2E_REQUIRED:-0}" = "1" ]; then exit 1; fi
  exit 0
}

command -v docker >/dev/null 2>&1 || skip "docker CLI not found"
docker info >/dev/null 2>&1 || skip "no Docker engine answers 'docker info'"
command -v kind >/dev/null 2>&1 || skip "kind not found (https://kind.sigs.k8s.io)"
if ! command -v helm >/dev/null 2>&1 || ! command -v kubectl >/dev/null 2>&1; then
  make tools
fi
[ -x "$PYTHON" ] || make venv

WORK=${WEIGHTCACHE_E2E_WORKDIR:-$(mktemp -d -t weightcache-e2e.XXXXXX)}
MODELS="$WORK/models"
KUBECONFIG_FILE="$WORK/kubeconfig"
mkdir -p "$MODELS"

cleanup() {
  if [ "${KEEP_CLUSTER:-0}" != "1" ]; then
    kind delete cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" >/dev/null 2>&1 || true
  else
    echo "e2e: cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG_FILE"
  fi
}
trap cleanup EXIT

echo "e2e: generating the checkpoint in $MODELS/tiny-llama"
"$PYTHON" -c 'import sys
from weightcache.bench.demo import TINY, write_llama_checkpoint
write_llama_checkpoint(sys.argv[1], TINY)' "$MODELS/tiny-llama"
chmod -R a+rX "$MODELS"

echo "e2e: building images"
docker build -f Dockerfile.agent --target native \
  --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL:-}" -t "weightcache/agent:$TAG" .
docker build -f Dockerfile.operator -t "weightcache/operator:$TAG" .

echo "e2e: creating kind cluster $CLUSTER"
sed "s#__MODELS_DIR__#$MODELS#g; s#name: weightcache-e2e#name: $CLUSTER#" e2e/kind.yaml >"$WORK/kind.yaml"
kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" \
  --kubeconfig "$KUBECONFIG_FILE" --wait 180s
kind load docker-image --name "$CLUSTER" "weightcache/agent:$TAG" "weightcache/operator:$TAG"

echo "e2e: running the suite"
WEIGHTCACHE_E2E_KUBECONFIG="$KUBECONFIG_FILE" \
  "$PYTHON" -m pytest -v -rs -p no:cacheprovider e2e "$@"
