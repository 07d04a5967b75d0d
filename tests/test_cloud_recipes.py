"""The shipped cluster recipes (docs/clusters/): the KubeRay `RayJob` manifest and the `ray up`
cluster file, read the way KubeRay and `ray up` read them (Ray's own translation of a RayCluster
spec into its autoscaler's config, Ray's own cluster-config schema and defaults), and every
`python -m runner` command in them and in docs/cloud.md's autoscaling section run through the
runner's own config loader (`load_config` and `split`, as `python -m runner` does): a misspelt key
or a bad value fails here, not on a cluster that took minutes to start. No cluster, no network."""
import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

from runner.io import storage
from runner.config import ConfigError, load_config, split

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "docs" / "clusters" / "kuberay-rayjob.yaml"
CLUSTER_FILE = ROOT / "docs" / "clusters" / "ray-up-aws.yaml"
CLOUD_DOC = ROOT / "docs" / "cloud.md"
SECTION = "## Autoscaling and spot clusters"
RUNNER = re.compile(r"\bpython3? -m runner(\s|$)")


def runner_argv(command: str) -> list[str]:
    """The arguments after `python -m runner` in a shell command line."""
    tokens = shlex.split(command, comments=True)
    for i in range(len(tokens) - 2):
        if tokens[i] in ("python", "python3") and tokens[i + 1:i + 3] == ["-m", "runner"]:
            return tokens[i + 3:]
    raise AssertionError(f"no `python -m runner` in {command!r}")


def commands_in(text: str) -> list[str]:
    """Shell commands that run the job in a text (a YAML file's comments, a Markdown section): one
    per line, `\\` continuations joined, a leading `#` (a comment's) taken off."""
    out, pending = [], ""
    for line in text.splitlines():
        line = re.sub(r"^\s*#", "", line).strip()
        pending = f"{pending} {line}".strip() if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if RUNNER.search(pending):
            out.append(pending)
        pending = ""
    return out


def checked_job(argv: list[str], where: str) -> dict:
    """The job's typed config, as the CLI builds it; a ConfigError fails the test naming `where`."""
    try:
        return split(load_config(argv))
    except ConfigError as e:
        error = e
    pytest.fail(f"{where}: python -m runner {' '.join(argv)}: {error}", pytrace=False)


def on_object_store(job: dict) -> bool:
    """Prompts and outputs on s3:// or gs://: the nodes need no shared filesystem."""
    return all(storage.is_uri(p) for p in job["prompts"].paths) \
        and storage.is_uri(job["output"].job_dir)


# ---------------------------------------------------------------------------------------------
# KubeRay

def manifest() -> tuple[list[dict], dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    jobs = [d for d in docs if d.get("kind") == "RayJob"]
    assert len(jobs) == 1, f"{MANIFEST.name}: one RayJob expected, found {len(jobs)}"
    return docs, jobs[0]


def gpus_of(group: dict) -> int:
    """GPUs a pod of a group asks Kubernetes for (its Ray container's limits)."""
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def gpu_groups(job: dict) -> list[dict]:
    return [g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"] if gpus_of(g)]


def test_manifest_is_a_rayjob_whose_gpu_workers_scale_from_zero():
    docs, job = manifest()
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), f"{MANIFEST.name}: {d}"
        assert d["metadata"].get("name"), f"{MANIFEST.name}: a {d['kind']} without a name"
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert isinstance(spec["entrypoint"], str) and spec["entrypoint"].strip()
    assert spec["shutdownAfterJobFinishes"] is True        # the cluster goes with the job
    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    idle_s = cluster["autoscalerOptions"]["idleTimeoutSeconds"]
    assert isinstance(idle_s, int) and idle_s > 0
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"       # the driver's node takes no GPU worker
    for group in [head, *cluster["workerGroupSpecs"]]:     # KubeRay takes strings only
        bad = {k: v for k, v in group.get("rayStartParams", {}).items() if not isinstance(v, str)}
        assert not bad, f"{MANIFEST.name}: rayStartParams values must be strings: {bad}"
    groups = gpu_groups(job)
    assert groups, f"{MANIFEST.name}: no worker group asks for nvidia.com/gpu"
    for g in groups:
        assert g["minReplicas"] == 0 and g.get("replicas", 0) == 0, g["groupName"]
        assert g["maxReplicas"] >= 1, g["groupName"]
        requests = g["template"]["spec"]["containers"][0]["resources"].get("requests", {})
        assert int(requests.get("nvidia.com/gpu", gpus_of(g))) == gpus_of(g), g["groupName"]
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    for group in [head, *cluster["workerGroupSpecs"]]:
        account = group["template"]["spec"].get("serviceAccountName")
        assert account is None or account in accounts, f"service account {account!r} not defined"


def test_manifest_as_rays_autoscaler_reads_it():
    """Ray's KubeRay translation (what the autoscaler sidecar runs on the RayCluster the RayJob
    creates; it validates the result against Ray's schema): GPU node types from 0 to maxReplicas."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _HEAD_GROUP_NAME, _derive_autoscaling_config_from_ray_cr)
    _, job = manifest()
    spec = job["spec"]["rayClusterSpec"]
    ray_cr = {"metadata": {"name": job["metadata"]["name"],
                           "namespace": job["metadata"].get("namespace", "default")},
              "spec": copy.deepcopy(spec)}
    config = _derive_autoscaling_config_from_ray_cr(ray_cr)
    types = config["available_node_types"]
    assert types[_HEAD_GROUP_NAME]["resources"].get("GPU", 0) == 0
    for g in gpu_groups(job):
        t = types[g["groupName"]]
        assert t["min_workers"] == 0
        assert t["max_workers"] == g["maxReplicas"] * g.get("numOfHosts", 1)
        assert t["resources"]["GPU"] == gpus_of(g)
    assert config["idle_timeout_minutes"] == spec["autoscalerOptions"]["idleTimeoutSeconds"] / 60


def test_manifest_entrypoint_is_a_valid_job():
    _, job = manifest()
    argv = runner_argv(job["spec"]["entrypoint"])
    cfg = checked_job(argv, f"{MANIFEST.name} entrypoint")
    gpus = sum(g["maxReplicas"] * g.get("numOfHosts", 1) * gpus_of(g) for g in gpu_groups(job))
    assert cfg["ray"].max_workers == gpus, "ray.max_workers should be the GPUs the cluster can grow to"
    assert on_object_store(cfg), "prompts.path and output.dir on s3:// or gs://"


# ---------------------------------------------------------------------------------------------
# `ray up`

def cluster_file() -> dict:
    return yaml.safe_load(CLUSTER_FILE.read_text())


def test_cluster_file_is_a_ray_up_config_whose_gpu_nodes_scale_from_zero():
    """What `ray up` does with the file before starting anything: Ray's defaults for the provider
    merged in (`prepare_config`), then Ray's schema and checks (`validate_config`)."""
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = cluster_file()
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    assert raw["provider"]["type"] in ("aws", "gcp")
    types = raw["available_node_types"]
    assert types[raw["head_node_type"]]["resources"].get("GPU") == 0
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, f"{CLUSTER_FILE.name}: no node type with GPU in its resources"
    for name, t in gpu_types.items():
        assert t["min_workers"] == 0 and t["max_workers"] >= 1, name
    assert sum(t["max_workers"] for t in gpu_types.values()) <= raw["max_workers"]
    assert raw["idle_timeout_minutes"] > 0
    head_start = " ".join(raw["head_start_ray_commands"])
    assert "--head" in head_start and "--num-gpus=0" in head_start
    # the project reaches every node and is installed there
    (target, source), = raw["file_mounts"].items()
    assert source == "."
    assert any("pip install" in c and target in c for c in raw["setup_commands"])


def test_cluster_file_commands_are_valid_jobs():
    raw = cluster_file()
    commands = commands_in(CLUSTER_FILE.read_text())
    assert commands, f"{CLUSTER_FILE.name}: no `python -m runner` command in its comments"
    gpus = sum(t["max_workers"] * t["resources"]["GPU"]
               for t in raw["available_node_types"].values() if t["resources"].get("GPU", 0))
    for command in commands:
        cfg = checked_job(runner_argv(command), f"{CLUSTER_FILE.name}")
        assert cfg["ray"].max_workers == gpus, command
        assert on_object_store(cfg), command


# ---------------------------------------------------------------------------------------------
# docs/cloud.md

def section() -> str:
    text = CLOUD_DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end >= 0 else None]


def test_cloud_doc_section_names_the_recipes_and_its_commands_are_valid_jobs():
    text = section()
    for path in (MANIFEST, CLUSTER_FILE):
        assert str(path.relative_to(ROOT / "docs")) in text, f"{SECTION} should link {path.name}"
    commands = commands_in(text)
    assert commands
    for command in commands:
        checked_job(runner_argv(command), f"docs/cloud.md, {SECTION[3:]}")


def test_a_misspelt_key_fails():
    """The check above is not vacuous: a key one letter off is refused, naming the right one."""
    with pytest.raises(ConfigError, match="did you mean 'ray.max_workers'"):
        load_config(["job=pixart_batch", "ray.max_worker=8"])


@pytest.mark.parametrize("args, key", [
    ("ray.min_workers=0", "ray.min_workers"), ("ray.max_workers=-1", "ray.max_workers"),
    ("ray.min_workers=4 ray.max_workers=2", "ray.min_workers"),
    ("ray.gpu_wait_s=-1", "ray.gpu_wait_s"), ("ray.gpu_gib=0", "ray.gpu_gib")])
def test_the_elastic_pool_keys_are_checked(args, key):
    with pytest.raises(ConfigError, match=key):
        split(load_config(["job=demo_image", *args.split()]))
