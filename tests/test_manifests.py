"""KubeRay manifests: the CRDs' schemas, the operator's rules, ray_forge's rules and the job's fit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ray_forge.cluster.manifests import crd_schemas, load_documents, node_groups, validate

ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = Path(os.environ.get("KUBERAY_CRD_DIR", ROOT.parent / "shared" / "kuberay"))  # KubeRay's config/crd/bases
MANIFESTS = [ROOT / "cluster" / "rayjob-blackjack.yaml", ROOT / "cluster" / "raycluster.yaml"]

pytestmark = pytest.mark.skipif(not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR} (set KUBERAY_CRD_DIR)")


@pytest.fixture(scope="module")
def schemas():
    return crd_schemas([doc for f in sorted(CRD_DIR.glob("*.yaml")) for doc in load_documents(f)])


@pytest.fixture()
def rayjob():
    return load_documents(MANIFESTS[0])[0]


def test_every_manifest_passes(schemas):
    assert set(schemas) >= {"RayJob", "RayCluster"}
    for path in MANIFESTS:
        for doc in load_documents(path):
            assert validate(doc, schemas, ROOT) == [], path


def test_the_raycluster_has_the_rayjobs_shape(rayjob):
    raycluster = load_documents(MANIFESTS[1])[0]
    assert raycluster["spec"] == rayjob["spec"]["rayClusterSpec"]


def test_the_job_config_fits_the_node_pools_derived_from_the_manifest(rayjob):
    from ray_forge.config import load_config
    from ray_forge.config.schema import JobConfig

    groups = {g.name: g for g in node_groups(rayjob["spec"]["rayClusterSpec"])}
    assert (groups["head"].cpus, groups["head"].gpus) == (0, 0)
    assert groups["gpu"].labels == {"ray_forge/pool": "gpu"} and groups["gpu"].gpus == 8
    assert groups["cpu"].labels == {"ray_forge/pool": "cpu"} and groups["cpu"].gpus == 0
    config = load_config(JobConfig, ROOT / "jobs/configs/blackjack_qwen3_1p7b.yaml")
    wanted = {pool: (sum(r.num_cpus for _, r in config.pools(gpus=True).get(pool, [])),
                     sum(r.num_gpus for _, r in config.pools(gpus=True).get(pool, [])))
              for pool in ("gpu", "cpu")}
    assert wanted["gpu"][1] == 5 and wanted["gpu"][1] <= groups["gpu"].gpus * groups["gpu"].replicas
    assert wanted["gpu"][0] <= groups["gpu"].cpus and wanted["cpu"][0] <= groups["cpu"].cpus


def broken(doc: dict, path: str, value) -> dict:
    """A copy of ``doc`` with the dotted ``path`` set to ``value`` (None deletes it)."""
    out = copy.deepcopy(doc)
    node, keys = out, path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is None:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return out


CLUSTER = "spec.rayClusterSpec"
SANDBOX_POD = f"{CLUSTER}.workerGroupSpecs.1.template.spec"
BROKEN = [
    # the CRD's schema
    ("spec.shutdownAfterJobFinishes", "yes", "shutdownAfterJobFinishes: 'yes' is not of type 'boolean'"),
    (f"{CLUSTER}.workerGroupSpecs.0.replicas", "one", "replicas: 'one' is not of type 'integer'"),
    (f"{CLUSTER}.workerGroupSpecs.0.groupName", None, "'groupName' is a required property"),
    (f"{CLUSTER}.workerGroupSpecs.0.replcas", 1, "Additional properties are not allowed ('replcas'"),
    # the operator's rules
    ("metadata.name", "ray-forge-blackjack-with-a-name-far-too-long-for-it", "at most 47"),
    ("metadata.name", "Ray_Forge", "not a DNS-1035 label"),
    ("spec.shutdownAfterJobFinishes", False, "ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes"),
    (f"{CLUSTER}.headGroupSpec.resources", {"CPU": "0"}, "resources set both in rayStartParams"),
    (f"{CLUSTER}.workerGroupSpecs.1.rayStartParams", {"labels": "ray_forge/pool=cpu"}, "put Ray node labels"),
    (f"{CLUSTER}.workerGroupSpecs.1.labels", {"ray_forge/pool": "cpu pool"}, "invalid label"),
    ("spec.runtimeEnvYAML", "- a list", "must be a YAML mapping"),
    # ray_forge's rules
    (f"{CLUSTER}.headGroupSpec.rayStartParams.num-cpus", "8", "group head: offers CPUs"),
    (f"{CLUSTER}.workerGroupSpecs.0.template.spec.containers.0.env",
     [{"name": "TOGETHER_API_KEY", "value": "sk-123"}], "written inline"),
    (f"{CLUSTER}.workerGroupSpecs.0.template.spec.containers.0.volumeMounts", [], "/dev/shm"),
    (f"{CLUSTER}.workerGroupSpecs.0.template.spec.containers.0.resources",
     {"limits": {"cpu": "96", "nvidia.com/gpu": "4"}}, "pool 'gpu': "),
    (f"{CLUSTER}.workerGroupSpecs.1.labels", {"ray_forge/pool": "cpus"}, "no worker group has nodes labelled"),
    ("spec.entrypoint", "python jobs/grpo.py --config jobs/configs/blackjack_qwen3_1p7b.yaml env.num_actors=9",
     "pool 'cpu': env needs 2 CPU"),
    # a job that Kubernetes restarts continues its run
    ("spec.backoffLimit", 0, "spec.backoffLimit is 0"),
    ("spec.entrypoint", "python jobs/grpo.py --config jobs/configs/blackjack_qwen3_1p7b.yaml", "no --resume auto"),
    ("spec.entrypoint", "python jobs/grpo.py --config jobs/configs/blackjack_qwen3_1p7b.yaml --resume auto "
     "run.output_dir=/tmp/runs", "group head: run.output_dir /tmp/runs is not on a PersistentVolumeClaim mount"),
    (f"{CLUSTER}.workerGroupSpecs.0.template.spec.containers.0.volumeMounts", [{"name": "dshm", "mountPath": "/dev/shm"}],
     "group gpu: run.output_dir /data/runs is not on a PersistentVolumeClaim mount"),
    ("spec.entrypoint", "python jobs/grpo.py --config jobs/configs/blackjack_qwen3_1p7b.yaml --resume auto "
     "run.output_dir=/database/runs", "is not on a PersistentVolumeClaim mount"),
    # the sandbox pods: what the code sandbox needs, and nothing more
    (f"{SANDBOX_POD}.containers.0.env", [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "h", "key": "t"}}}],
     "HF_TOKEN must not reach the sandbox pods"),
    (f"{SANDBOX_POD}.securityContext.seccompProfile", {"type": "RuntimeDefault"}, "the sandbox needs user namespaces"),
    (f"{SANDBOX_POD}.securityContext.appArmorProfile", None, "mounts in a user namespace"),
    (f"{SANDBOX_POD}.securityContext.runAsNonRoot", None, "runAsNonRoot: true"),
    (f"{SANDBOX_POD}.securityContext.runAsUser", 0, "runAsNonRoot: true"),
    (f"{SANDBOX_POD}.containers.0.securityContext.capabilities", {"add": ["SYS_ADMIN"]}, "drop ALL capabilities"),
    (f"{SANDBOX_POD}.containers.0.securityContext.privileged", True, "no privileged"),
    (f"{SANDBOX_POD}.containers.0.securityContext.allowPrivilegeEscalation", None, "allowPrivilegeEscalation: false"),
    (f"{SANDBOX_POD}.hostPID", True, "hostPID exposes the node"),
    (f"{SANDBOX_POD}.volumes", [{"name": "data", "persistentVolumeClaim": {"claimName": "ray-forge-data"}}],
     "volume data (persistentVolumeClaim) does not belong"),
]


@pytest.mark.parametrize("path,value,message", BROKEN, ids=[f"{p}={v}"[:60] for p, v, _ in BROKEN])
def test_a_broken_copy_fails_and_says_why(schemas, rayjob, path, value, message):
    errors = validate(broken(rayjob, path, value), schemas, ROOT)
    assert any(message in e for e in errors), errors


def test_the_sandbox_pods_carry_no_hf_token_and_only_the_sandboxs_needs(rayjob):
    """The env pool's group is the one with the sandbox rules, and the shipped one passes them."""
    cpu = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]
    assert cpu["labels"] == {"ray_forge/pool": "cpu"}
    pod = cpu["template"]["spec"]
    assert [v["name"] for v in pod["containers"][0]["env"]] == ["TOGETHER_API_KEY"]
    assert "volumes" not in pod and pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_the_command_validates_and_fails_with_reasons(tmp_path, rayjob):
    command = [sys.executable, "-m", "ray_forge.cluster.manifests", "--crd-dir", str(CRD_DIR), "--root", str(ROOT)]
    ok = subprocess.run([*command, *map(str, MANIFESTS)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("ok  ") == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(broken(rayjob, "spec.shutdownAfterJobFinishes", False)))
    crd_file = [f"--crd={f}" for f in sorted(CRD_DIR.glob("*.yaml"))]
    failed = subprocess.run([sys.executable, "-m", "ray_forge.cluster.manifests", *crd_file, "--root", str(ROOT), str(bad)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert failed.returncode == 1
    assert "FAIL" in failed.stdout and "needs spec.shutdownAfterJobFinishes" in failed.stdout
