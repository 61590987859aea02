#!/usr/bin/env bash
# Set up and use ray_forge on a Kubernetes GPU cluster (e.g. a Together Instant Cluster).
#   cluster/setup.sh operator     install the KubeRay operator (pinned) and check the manifests against its CRDs
#   cluster/setup.sh secrets      create the Secrets from TOGETHER_API_KEY / HF_TOKEN in this shell's environment
#   cluster/setup.sh job          run the BlackJack RayJob and follow it
#   cluster/setup.sh cluster      start the long-lived RayCluster instead
#   cluster/setup.sh dashboard    port-forward the Ray dashboard to http://127.0.0.1:8265 (and metrics to :8080);
#                                 `dashboard job` for the RayJob's cluster
#   cluster/setup.sh submit ARGS  `ray job submit` to the forwarded RayCluster, e.g. run.steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
KUBERAY_VERSION="${KUBERAY_VERSION:-1.7.0}"   # manifests were checked against the v1.7.0 CRDs
NAMESPACE="${NAMESPACE:-default}"
PY="${PY:-python}"
k() { kubectl --namespace "$NAMESPACE" "$@"; }

case "${1:-}" in
  operator)
    helm repo add kuberay https://ray-project.github.io/kuberay-helm/ >/dev/null
    helm repo update kuberay >/dev/null
    helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" --wait
    "$PY" -m ray_forge.cluster.manifests --from-cluster cluster/rayjob-blackjack.yaml cluster/raycluster.yaml ;;
  secrets)
    # Values go through stdin, so they never appear in a command line, a file or a manifest.
    if [[ -n "${TOGETHER_API_KEY:-}" ]]; then
      printf %s "$TOGETHER_API_KEY" | k create secret generic together-api --from-file=api-key=/dev/stdin \
        --dry-run=client -o yaml | k apply -f -
    fi
    if [[ -n "${HF_TOKEN:-}" ]]; then
      printf %s "$HF_TOKEN" | k create secret generic hf-token --from-file=token=/dev/stdin \
        --dry-run=client -o yaml | k apply -f -
    fi ;;
  job)
    "$PY" -m ray_forge.cluster.manifests --from-cluster cluster/rayjob-blackjack.yaml
    k apply -f cluster/pvc.yaml -f cluster/rayjob-blackjack.yaml
    k get rayjob ray-forge-blackjack -w ;;
  cluster)
    "$PY" -m ray_forge.cluster.manifests --from-cluster cluster/raycluster.yaml
    k apply -f cluster/pvc.yaml -f cluster/raycluster.yaml
    k wait --for=condition=ready pod -l ray.io/cluster=ray-forge --timeout=30m ;;
  dashboard)
    # The RayCluster's head, or with `dashboard job` the head of the cluster the RayJob made.
    name=ray-forge
    if [[ "${2:-}" == job ]]; then name=$(k get rayjob ray-forge-blackjack -o jsonpath='{.status.rayClusterName}'); fi
    k port-forward "svc/${name}-head-svc" 8265:8265 8080:8080 ;;
  submit)
    shift
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
      python jobs/grpo.py --config jobs/configs/blackjack_qwen3_1p7b.yaml "$@" ;;
  *)
    sed -n '2,9p' "$0"; exit 2 ;;
esac
