"""Check KubeRay manifests offline: the CRDs' schemas, the operator's own rules, and the job's fit.

    python -m ray_forge.cluster.manifests cluster/rayjob-blackjack.yaml cluster/raycluster.yaml --crd-dir DIR
    kubectl get crd rayjobs.ray.io rayclusters.ray.io -o yaml > crds.yaml
    python -m ray_forge.cluster.manifests cluster/*.yaml --crd crds.yaml

Three layers, each giving messages that say where and why:
1. the OpenAPI schema of the kind, from the CRD (unknown fields are errors, as with
   ``kubectl apply --validate=strict``);
2. the rules the KubeRay operator enforces beyond the schema (names, TTL, resources, labels);
3. ray_forge's own rules: secrets only from Secrets, a quiet head, ``/dev/shm`` on GPU pods, the
   env pool's pods set up for the code sandbox and nothing more, and the job config's placement
   groups fitting the node groups (for a RayJob whose entrypoint names a config).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ray_forge.config.schema import POOL_LABEL

KINDS = {"RayJob": "rayjobs.ray.io", "RayCluster": "rayclusters.ray.io"}
MAX_NAME = {"RayJob": 47, "RayCluster": 63}  # the operator's limits (names feed derived resources)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
SANDBOX_POOL = "cpu"  # the pool label of the env actors' nodes, where the code sandbox runs
_NOT_ON_SANDBOX_PODS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


class ManifestError(ValueError):
    """A manifest or CRD file could not be read."""


# -- loading --------------------------------------------------------------------------------------

def load_documents(path: str | Path) -> list[dict]:
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as err:
        raise ManifestError(f"{path}: cannot read YAML: {err}") from err
    return [item for doc in docs for item in (doc.get("items", []) if doc.get("kind") == "List" else [doc])]


def crd_schemas(docs: list[dict], version: str = "v1") -> dict[str, dict]:
    """Kind -> OpenAPI v3 schema of ``version``, from CRD documents (files or ``kubectl get crd``)."""
    schemas = {}
    for doc in docs:
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        for ver in doc["spec"]["versions"]:
            if ver["name"] == version:
                schemas[doc["spec"]["names"]["kind"]] = ver["schema"]["openAPIV3Schema"]
    return schemas


def crds_from_cluster() -> list[dict]:
    out = subprocess.run(["kubectl", "get", "crd", *KINDS.values(), "-o", "yaml"], capture_output=True,
                         text=True, timeout=60)
    if out.returncode:
        raise ManifestError(f"kubectl get crd failed: {out.stderr.strip()}")
    return [item for doc in yaml.safe_load_all(out.stdout) if doc for item in doc.get("items", [doc])]


# -- 1. schema ------------------------------------------------------------------------------------

def _strict(schema: dict) -> dict:
    """Unknown fields become errors where Kubernetes would prune them (structural schemas)."""
    node = dict(schema)
    if "properties" in node:
        node["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = _strict(node[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            node[key] = [_strict(s) for s in node[key]]
    if node.get("x-kubernetes-int-or-string"):
        node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return node


def _where(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def schema_errors(doc: dict, schema: dict) -> list[str]:
    from jsonschema import Draft7Validator

    validator = Draft7Validator(_strict(schema))
    return sorted(f"{_where(err.absolute_path)}: {err.message}" for err in validator.iter_errors(doc))


# -- 2. the operator's rules -----------------------------------------------------------------------

def _groups(cluster_spec: dict) -> list[tuple[str, dict]]:
    head = [("head", cluster_spec.get("headGroupSpec") or {})]
    return head + [(g.get("groupName", f"worker[{i}]"), g) for i, g in enumerate(cluster_spec.get("workerGroupSpecs") or [])]


def _name_errors(doc: dict) -> list[str]:
    kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name", "")
    errors = []
    if len(name) > MAX_NAME[kind]:
        errors.append(f"metadata.name: {kind} name {name!r} has {len(name)} characters; at most {MAX_NAME[kind]}")
    if not _DNS1035.match(name):
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits and '-', "
                      "starting with a letter)")
    return errors


def _label_ok(key: str, value: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return (bool(_LABEL_NAME.match(name)) and len(name) <= 63 and len(prefix) <= 253
            and bool(_LABEL_VALUE.match(value)) and len(value) <= 63)


def cluster_spec_errors(spec: dict, where: str) -> list[str]:
    errors = []
    for name, group in _groups(spec):
        params, resources, labels = group.get("rayStartParams") or {}, group.get("resources") or {}, group.get("labels") or {}
        at = f"{where} group {name}"
        if not ((group.get("template") or {}).get("spec") or {}).get("containers"):
            errors.append(f"{at}: the pod template has no container")
        if any(params.get(p) for p in _RESOURCE_PARAMS) and resources:
            errors.append(f"{at}: resources set both in rayStartParams and in resources; use only one")
        if "labels" in params:
            errors.append(f"{at}: rayStartParams['labels'] is not supported; put Ray node labels in the group's labels")
        errors += [f"{at}: invalid label {k}={v!r}" for k, v in labels.items() if not _label_ok(k, str(v))]
    return errors


def operator_errors(doc: dict) -> list[str]:
    """What the KubeRay operator rejects although the schema allows it (its validation.go)."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    errors = _name_errors(doc)
    if kind == "RayCluster":
        return errors + cluster_spec_errors(spec, "spec")
    ttl, shutdown = spec.get("ttlSecondsAfterFinished", 0), spec.get("shutdownAfterJobFinishes", False)
    if ttl < 0:
        errors.append("spec.ttlSecondsAfterFinished must not be negative")
    if ttl > 0 and not shutdown:
        errors.append("spec.ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes: true")
    if spec.get("suspend") and not shutdown:
        errors.append("spec.suspend needs spec.shutdownAfterJobFinishes: true")
    if "activeDeadlineSeconds" in spec and spec["activeDeadlineSeconds"] <= 0:
        errors.append("spec.activeDeadlineSeconds must be positive")
    if spec.get("backoffLimit", 0) < 0:
        errors.append("spec.backoffLimit must not be negative")
    if not spec.get("rayClusterSpec") and not spec.get("clusterSelector"):
        errors.append("spec: one of rayClusterSpec or clusterSelector must be set")
    try:
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}")
        if not isinstance(runtime_env, dict):
            errors.append("spec.runtimeEnvYAML must be a YAML mapping")
    except yaml.YAMLError as err:
        errors.append(f"spec.runtimeEnvYAML is not valid YAML: {err}")
    if spec.get("rayClusterSpec"):
        errors += cluster_spec_errors(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return errors


# -- 3. ray_forge's rules --------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeGroup:
    """What one Ray node of a group offers to tasks, and how many such nodes there are."""

    name: str
    replicas: int
    cpus: float
    gpus: float
    labels: dict[str, str] = field(default_factory=dict)


def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def node_groups(cluster_spec: dict) -> list[NodeGroup]:
    """Ray's view of each group: rayStartParams win, then the container's limits (then requests)."""
    out = []
    for name, group in _groups(cluster_spec):
        params = group.get("rayStartParams") or {}
        container = ((group.get("template") or {}).get("spec") or {}).get("containers", [{}])[0]
        res = container.get("resources") or {}
        limits = {**(res.get("requests") or {}), **(res.get("limits") or {})}
        cpus = params.get("num-cpus", (group.get("resources") or {}).get("CPU", limits.get("cpu", 0)))
        gpus = params.get("num-gpus", (group.get("resources") or {}).get("GPU", limits.get("nvidia.com/gpu", 0)))
        replicas = 1 if name == "head" else int(group.get("replicas", group.get("minReplicas", 0)))
        out.append(NodeGroup(name, replicas, _quantity(cpus), _quantity(gpus), dict(group.get("labels") or {})))
    return out


def project_errors(doc: dict) -> list[str]:
    """Secrets only through secretKeyRef; a head that takes no work; /dev/shm on GPU pods; sandbox
    pods set up for the sandbox alone."""
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterSpec") if doc.get("kind") == "RayJob" else spec
    if not cluster:
        return []
    errors = []
    for (name, group), nodes in zip(_groups(cluster), node_groups(cluster)):
        pod = (group.get("template") or {}).get("spec") or {}
        for container in pod.get("containers") or []:
            for var in container.get("env") or []:
                if _SECRET_NAME.search(var.get("name", "")) and "value" in var:
                    errors.append(f"group {name}: env {var['name']} is written inline; take it from a Secret "
                                  "(valueFrom.secretKeyRef)")
        if name == "head" and (nodes.cpus or nodes.gpus):
            errors.append("group head: offers CPUs or GPUs to tasks; set rayStartParams num-cpus and num-gpus to '0'")
        in_memory = {v["name"] for v in pod.get("volumes") or [] if (v.get("emptyDir") or {}).get("medium") == "Memory"}
        shm = [m for c in pod.get("containers") or [] for m in c.get("volumeMounts") or []
               if m.get("mountPath") == "/dev/shm" and m.get("name") in in_memory]
        if nodes.gpus and not shm:
            errors.append(f"group {name}: GPU pods need a memory-backed /dev/shm volume (vLLM, NCCL, shm weights)")
        if nodes.labels.get(POOL_LABEL) == SANDBOX_POOL:
            errors += sandbox_pod_errors(name, pod)
    return errors


def sandbox_pod_errors(name: str, pod: dict) -> list[str]:
    """The env pool's pods get what the code sandbox needs (user namespaces and mounts inside them,
    which the default seccomp and AppArmor profiles refuse) and nothing more: the image's non-root
    user, no capability, no privilege escalation, no host namespaces or paths, no HF token, no data
    volume."""
    at, context = f"group {name} (sandbox pods)", pod.get("securityContext") or {}
    containers = pod.get("containers") or []
    errors = []
    if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
        errors.append(f"{at}: set securityContext.runAsNonRoot: true (the image's user, not root)")
    for profile, why in (("seccompProfile", "user namespaces"), ("appArmorProfile", "mounts in a user namespace")):
        types = {(context.get(profile) or {}).get("type")} | {((c.get("securityContext") or {}).get(profile) or {})
                                                             .get("type") for c in containers} - {None}
        if types != {"Unconfined"}:
            errors.append(f"{at}: the sandbox needs {why}, which the default {profile} refuses; set "
                          f"securityContext.{profile}.type: Unconfined (it would refuse to start)")
    for container in containers:
        sc, where = container.get("securityContext") or {}, f"{at} container {container.get('name')}"
        capabilities = sc.get("capabilities") or {}
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
            errors.append(f"{where}: set allowPrivilegeEscalation: false and no privileged")
        if "ALL" not in (capabilities.get("drop") or []) or capabilities.get("add"):
            errors.append(f"{where}: drop ALL capabilities and add none (the sandbox needs none)")
        errors += [f"{where}: {var['name']} must not reach the sandbox pods" for var in container.get("env") or []
                   if var.get("name") in _NOT_ON_SANDBOX_PODS]
    errors += [f"{at}: {key} exposes the node to the sandbox" for key in ("hostPID", "hostIPC", "hostNetwork")
               if pod.get(key)]
    errors += [f"{at}: volume {v.get('name')} ({kind}) does not belong on sandbox pods"
               for v in pod.get("volumes") or [] for kind in ("hostPath", "persistentVolumeClaim") if kind in v]
    return errors


def job_config_from_entrypoint(entrypoint: str, root: Path):
    """The JobConfig a ``python jobs/<job>.py --config X key=value ...`` entrypoint would load."""
    from ray_forge.config import load_config
    from ray_forge.config.schema import JobConfig

    argv = shlex.split(entrypoint)
    if "--config" not in argv:
        return None
    path = argv[argv.index("--config") + 1]
    overrides = [a for a in argv[argv.index("--config") + 2:] if "=" in a and not a.startswith("-")]
    return load_config(JobConfig, root / path, overrides)


def placement_errors(config, groups: list[NodeGroup]) -> list[str]:
    """Every pool's bundles must pack onto the nodes carrying its label (first fit, largest first)."""
    errors = []
    for pool, members in config.pools(gpus=any(g.gpus for g in groups)).items():
        label = config.cluster.pool_labels.get(pool)
        nodes = [[g.cpus, g.gpus] for g in groups for _ in range(g.replicas)
                 if label is None or g.labels.get(POOL_LABEL) == label]
        where = f"nodes labelled {POOL_LABEL}={label}" if label else "any node"
        if not nodes:
            errors.append(f"pool {pool!r}: no worker group has {where}")
            continue
        for role, res in sorted(members, key=lambda m: (-m[1].num_gpus, -m[1].num_cpus)):
            node = next((n for n in nodes if n[0] >= res.num_cpus and n[1] >= res.num_gpus), None)
            if node is None:
                free = ", ".join(f"{c:g} CPU/{g:g} GPU" for c, g in nodes)
                errors.append(f"pool {pool!r}: {role} needs {res.num_cpus:g} CPU and {res.num_gpus:g} GPU on {where}; "
                              f"left after the others: {free}")
                break
            node[0] -= res.num_cpus
            node[1] -= res.num_gpus
    return errors


# -- all of it -------------------------------------------------------------------------------------

def validate(doc: dict, schemas: dict[str, dict], root: Path = Path(".")) -> list[str]:
    """Every problem found in one manifest document (empty: it passes)."""
    kind = doc.get("kind")
    if kind not in KINDS:
        return []  # PVCs, Secrets...: Kubernetes' own kinds, not checked here
    if kind not in schemas:
        raise ManifestError(f"no CRD schema for {kind} (give the {KINDS[kind]} CRD)")
    errors = schema_errors(doc, schemas[kind])
    if errors:  # the rules below assume the schema's shapes
        return errors
    errors = operator_errors(doc) + project_errors(doc)
    spec = doc["spec"]
    if kind == "RayJob" and spec.get("rayClusterSpec"):
        config = job_config_from_entrypoint(spec["entrypoint"], root) if spec.get("entrypoint") else None
        if config is not None:
            errors += placement_errors(config, node_groups(spec["rayClusterSpec"]))
            errors += restart_errors(spec, config)
    return errors


def restart_errors(spec: dict, config) -> list[str]:
    """A RayJob that Kubernetes restarts continues its run: it is retried (backoffLimit), the retry
    resumes (``--resume auto``), and the run directory is on a volume that outlives the pods,
    mounted wherever it is written (the head's driver and the trainer ranks' pods)."""
    errors = []
    if spec.get("backoffLimit", 0) < 1:
        errors.append("spec.backoffLimit is 0: a run whose head pod is lost is not retried; set it >= 1 "
                      "(the entrypoint's --resume auto continues the run)")
    if "--resume auto" not in " ".join(shlex.split(spec["entrypoint"])):
        errors.append("spec.entrypoint has no --resume auto: a retried job would start the run again from step 0")
    output = config.run.output_dir
    trainer_label = config.cluster.pool_labels.get(config.trainer.resources.pool)
    for name, group in _groups(spec["rayClusterSpec"]):
        if name != "head" and (group.get("labels") or {}).get(POOL_LABEL) != trainer_label:
            continue
        pod = (group.get("template") or {}).get("spec") or {}
        claims = {v["name"] for v in pod.get("volumes") or [] if "persistentVolumeClaim" in v}
        mounts = [m["mountPath"].rstrip("/") + "/" for c in pod.get("containers") or []
                  for m in c.get("volumeMounts") or [] if m.get("name") in claims]
        if not any((output.rstrip("/") + "/").startswith(m) for m in mounts):
            errors.append(f"group {name}: run.output_dir {output} is not on a PersistentVolumeClaim mount; "
                          "checkpoints written there are lost with the pod")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifests", nargs="+")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--crd", action="append", help="a CRD YAML file (repeatable; `kubectl get crd ... -o yaml`)")
    source.add_argument("--crd-dir", help="a folder of CRD YAML files (KubeRay's config/crd/bases)")
    source.add_argument("--from-cluster", action="store_true", help="read the CRDs with kubectl")
    parser.add_argument("--root", default=".", help="where entrypoint config paths are relative to")
    args = parser.parse_args(argv)
    if args.from_cluster:
        crds = crds_from_cluster()
    else:
        files = args.crd or sorted(Path(args.crd_dir).glob("*.yaml"))
        crds = [doc for f in files for doc in load_documents(f)]
    schemas = crd_schemas(crds)
    failed = 0
    for path in args.manifests:
        for doc in load_documents(path):
            errors = validate(doc, schemas, Path(args.root))
            name = f"{path}: {doc.get('kind')} {(doc.get('metadata') or {}).get('name')}"
            print(f"{'FAIL' if errors else 'ok  '} {name}")
            for err in errors:
                print(f"       {err}")
            failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
