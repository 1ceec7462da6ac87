"""The autoscaling examples (examples/autoscale): the Ray cluster YAML for the VM autoscaler and the KubeRay
RayCluster manifest parse, and hold what dit-serve relies on: GPU workers from 0, a head without a GPU (no
worker lands there), no more workers asked for than the cluster may have, and a dit-serve config that loads
with autoscaling on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dit_serve.server.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "autoscale"


def test_the_ray_cluster_yaml_scales_gpu_nodes_from_zero_for_the_services_workers():
    import jsonschema
    import ray.autoscaler

    cluster = yaml.safe_load((EXAMPLES / "ray-cluster-aws.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)  # what `ray up` checks first
    types = cluster["available_node_types"]
    head, gpu = types[cluster["head_node_type"]], types["gpu"]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0
    assert gpu["resources"]["GPU"] == 1 and gpu["min_workers"] == 0 and gpu["max_workers"] >= 1
    assert "--num-gpus=0" in " ".join(cluster["head_start_ray_commands"])
    assert "--autoscaling-config" in " ".join(cluster["head_start_ray_commands"])
    assert cluster["idle_timeout_minutes"] > 0 and cluster["provider"]["cache_stopped_nodes"] is False

    (target, source), = cluster["file_mounts"].items()
    cfg = load_config(EXAMPLES.parents[1] / source)
    assert target == "~/dit-serve.toml" and cfg.ray.address == "auto"
    assert cfg.autoscale.enabled and cfg.autoscale.min_workers == 0 and cfg.workers.resource == "GPU"
    assert cfg.autoscale.worker_bundle(cfg.workers) == {"GPU": 1.0}  # what each worker asks Ray for
    assert cfg.autoscale.max_workers <= min(gpu["max_workers"], cluster["max_workers"])
    assert cfg.server.host == "0.0.0.0"


def test_the_kuberay_manifest_autoscales_a_gpu_group_from_zero_with_dit_serve_in_the_head_pod(tmp_path):
    docs = {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / "kuberay-raycluster.yaml").read_text())}
    assert sorted(docs) == ["ConfigMap", "PersistentVolumeClaim", "RayCluster", "Service"]
    rc = docs["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert group["minReplicas"] == 0 == group["replicas"] and group["maxReplicas"] >= 1
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"

    containers = {c["name"]: c for c in head["template"]["spec"]["containers"]}
    serve = containers["dit-serve"]
    command = " ".join(serve["command"] + serve["args"])
    assert "dit-serve serve" in command and "--ray-address" in command and "--database-url" in command
    assert serve["image"] == worker["image"] == containers["ray-head"]["image"]  # one dit-serve and Ray everywhere
    mounts = {m["name"]: m["mountPath"] for m in serve["volumeMounts"]}
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert f"--config {mounts['config']}/dit-serve.toml" in command

    toml = tmp_path / "dit-serve.toml"
    toml.write_text(docs["ConfigMap"]["data"]["dit-serve.toml"])
    cfg = load_config(toml)
    assert cfg.autoscale.enabled and cfg.autoscale.min_workers == 0 and cfg.workers.resource == "GPU"
    assert cfg.autoscale.max_workers <= group["maxReplicas"]
    assert str(cfg.store.data_dir) == mounts["data"] and cfg.server.host == "0.0.0.0"

    service = docs["Service"]["spec"]
    assert service["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    (port,) = service["ports"]
    assert {p["name"]: p["containerPort"] for p in serve["ports"]}[port["targetPort"]] == cfg.server.port


@pytest.mark.parametrize("name", ["ray-cluster-aws.yaml", "kuberay-raycluster.yaml", "dit-serve.toml"])
def test_the_examples_say_how_to_run_them(name):
    text = (EXAMPLES / name).read_text()
    assert text.startswith("#") and ("kubectl apply" in text or "ray up" in text or "[autoscale]" in text)
