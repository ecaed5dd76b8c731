"""The chart renders for every values set, lints clean, and each mode gets what it needs, no more."""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import cel
import helm_python as helm
import pytest
import yaml
from chart_support import (
    CHART_DIR,
    NAMESPACE,
    REPO_ROOT,
    VALUES_FILES,
    load_values,
    render_chart,
    render_notes,
)

from driver.cli import _build_parser, build_controller_config, build_plugin_config
from driver.config import DEFAULT_POLICY, ControllerConfig

PROFILES_DIR = "/etc/fractional-dra/profiles"


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (
        f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def agent_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet", "-agent")["spec"]["template"]["spec"]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def env_of(container_spec: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or ("fieldRef", path) for downward-API variables."""
    env: dict[str, Any] = {}
    for entry in container_spec.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            env[entry["name"]] = ("fieldRef", entry["valueFrom"]["fieldRef"]["fieldPath"])
    return env


def host_paths(pod_spec: dict[str, Any], container_spec: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """host path -> (container path, read-only) for every hostPath the container mounts."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {}
    for mount in container_spec["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            mounts[volume["hostPath"]["path"]] = (mount["mountPath"], bool(mount.get("readOnly")))
    return mounts


@pytest.fixture(scope="module")
def fake() -> list[dict[str, Any]]:
    return render_chart(load_values("fake-values"))


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return render_chart(None)


# -- every values set ---------------------------------------------------------------------------


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_lint_reports_no_errors_or_warnings(values_name: str) -> None:
    report = helm.lint(str(CHART_DIR), load_values(values_name), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_renders_every_component(values_name: str) -> None:
    values = load_values(values_name)
    objects = render_chart(values)
    kinds = sorted(o["kind"] for o in objects)
    # With consolidation on, one more: the Deployments' pod template annotation (make before break).
    policies = 6 + bool(((values or {}).get("controller") or {}).get("consolidation", {}).get("enabled"))
    for kind, count in {
        "DaemonSet": 1,
        "Deployment": 1,
        "ConfigMap": 1,
        # The metrics Services, and the allocation guard's (no selector: the leader's EndpointSlice).
        "Service": 3,
        "Secret": 1,  # the allocation guard's serving certificate
        "ValidatingWebhookConfiguration": 1,  # the allocation guard
        "ServiceAccount": 2,
        "ClusterRole": 2,
        "ClusterRoleBinding": 2,
        "Role": 2,  # leader election, the allocation guard's EndpointSlice
        "RoleBinding": 2,
        "DeviceClass": 2,
        # The agent's ResourceSlices, the controller's pods, pods' status (preemption), evictions and
        # claims (the agent's claim-status policy only before 1.36; Helm renders offline for 1.36),
        # and the delete protection of the claims the controller allocated.
        "ValidatingAdmissionPolicy": policies,
        "ValidatingAdmissionPolicyBinding": policies,
        # The scheduling gate added to pods with claims, and to pods without claims in namespaces
        # that opt in (autoGate).
        "MutatingAdmissionPolicy": 2,
        "MutatingAdmissionPolicyBinding": 2,
        "PodDisruptionBudget": 1,
        "FlowSchema": 1,  # the controller's requests in workload-high, as kube-scheduler's
    }.items():
        assert kinds.count(kind) == count, f"{values_name}: {kind} x{kinds.count(kind)}"
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"
    namespaced = [o for o in objects if o["kind"] not in _CLUSTER_SCOPED]
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in namespaced)


_CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "ValidatingWebhookConfiguration",
    "FlowSchema",
}


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_agent_daemonset_basics(values_name: str) -> None:
    values = load_values(values_name) or {}
    objects = render_chart(values)
    daemonset = one(objects, "DaemonSet", "-agent")
    mps = (values.get("sharing") or {}).get("backend") == "mps"
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        # MPS daemons live in the agent's container: no two agent pods on a node at once.
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
        if mps
        else {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    agent = container(pod, "agent")
    assert agent["args"] == ["plugin"]
    env = env_of(agent)
    assert env["FRACTIONAL_NODE_NAME"] == ("fieldRef", "spec.nodeName")
    assert env["FRACTIONAL_POD_UID"] == ("fieldRef", "metadata.uid")
    # The kubelet dials the sockets by host path: identical paths inside the container.
    mounts = host_paths(pod, agent)
    for host_dir, flag in (
        ("/var/lib/kubelet/plugins_registry", "FRACTIONAL_REGISTRY_DIR"),
        ("/var/lib/kubelet/plugins/fractional.dev", "FRACTIONAL_PLUGIN_DIR"),
        ("/var/run/cdi", "FRACTIONAL_CDI_ROOT"),
    ):
        assert mounts[host_dir] == (host_dir, False)
        assert env[flag] == host_dir
    # Probes on the agent's HTTP endpoint, the port it is told to serve on.
    (port,) = agent["ports"]
    assert port["name"] == "metrics" and str(port["containerPort"]) == env["FRACTIONAL_METRICS_PORT"]
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert agent["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["resources"]["requests"] and agent["resources"]["limits"]["memory"]
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert env["FRACTIONAL_SHARING"] == values.get("sharing", {}).get("backend", "none")
    service = one(objects, "Service", "-agent-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


@pytest.mark.parametrize("values_name", sorted(VALUES_FILES))
def test_environment_is_understood_by_the_cli(values_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every FRACTIONAL_* variable the chart sets is a real flag twin and yields a valid config."""
    objects = render_chart(load_values(values_name))
    pod_env = env_of(container(agent_pod(objects), "agent"))
    controller_pod = one(objects, "Deployment", "-controller")["spec"]["template"]["spec"]
    controller_env = env_of(container(controller_pod, "controller"))
    downward = {"spec.nodeName": "node-a", "metadata.uid": "0d7f9b8e-uid", "metadata.namespace": NAMESPACE}
    downward["metadata.name"] = "fractional-dra-controller-abc"
    downward["status.podIP"] = "10.244.1.7"

    def parse(command: str, env: dict[str, Any]) -> argparse.Namespace:
        return parse_cli_env(monkeypatch, command, env, downward)

    plugin = build_plugin_config(parse("plugin", pod_env))
    assert plugin.node_name == "node-a" and plugin.pod_uid == "0d7f9b8e-uid"
    if plugin.backend == "fake":
        assert plugin.profile is not None and plugin.profile.startswith(PROFILES_DIR + "/")
    controller = build_controller_config(parse("controller", controller_env))
    assert controller.leader_elect is True
    assert controller.lease_namespace == NAMESPACE and controller.identity == downward["metadata.name"]
    configmap = one(objects, "ConfigMap", "-profiles")
    assert controller.hint_profiles, "the controller needs template nodes for scale-up hints"
    for path in controller.hint_profiles:
        assert path.startswith(PROFILES_DIR + "/") and path.rsplit("/", 1)[1] in configmap["data"]


def parse_cli_env(
    monkeypatch: pytest.MonkeyPatch, command: str, env: dict[str, Any], downward: dict[str, str]
) -> argparse.Namespace:
    """A container's FRACTIONAL_* environment (``env_of``) as ``fractional <command>`` reads it, the
    downward-API values taken from ``downward``; every variable must be a flag twin of the command."""
    for name in [n for n in os.environ if n.startswith("FRACTIONAL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("FRACTIONAL_"):
            monkeypatch.setenv(name, downward[value[1]] if isinstance(value, tuple) else value)
    parser = _build_parser()
    known = {
        "FRACTIONAL_" + option.lstrip("-").replace("-", "_").upper()
        for action in _subparser(parser, command)._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    unknown = sorted(n for n in env if n.startswith("FRACTIONAL_") and n not in known)
    assert unknown == [], f"{command}: no such flag twins: {unknown}"
    return parser.parse_args([command])


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("no subcommands")


# -- fake mode ----------------------------------------------------------------------------------


def test_fake_mode_runs_unprivileged_on_every_node(fake: list[dict[str, Any]]) -> None:
    pod = agent_pod(fake)
    agent = container(pod, "agent")
    security = agent["securityContext"]
    assert "privileged" not in security
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    # Root (without capabilities) only because the kubelet's socket dirs are root's.
    assert security["runAsUser"] == 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "nodeSelector" not in pod and "runtimeClassName" not in pod and "initContainers" not in pod
    # No host access beyond the three directories the kubelet and the runtime share with it.
    assert set(host_paths(pod, agent)) == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins/fractional.dev",
        "/var/run/cdi",
    }
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    env = env_of(agent)
    assert env["FRACTIONAL_BACKEND"] == "fake"
    assert env["FRACTIONAL_PROFILE"] == f"{PROFILES_DIR}/h100-8x.yaml"
    profiles = one(fake, "ConfigMap", "-profiles")["data"]
    shipped = (REPO_ROOT / "charts/fractional-dra/files/profiles/h100-8x.yaml").read_text(encoding="utf-8")
    assert yaml.safe_load(profiles["h100-8x.yaml"]) == yaml.safe_load(shipped)
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["profiles"] == PROFILES_DIR


def test_fake_mode_non_root_is_a_value() -> None:
    values = load_values("fake-values") or {}
    values["agent"] = {"runAsNonRoot": True, "runAsUser": 4242}
    security = container(agent_pod(render_chart(values)), "agent")["securityContext"]
    assert (
        security["runAsNonRoot"] is True and security["runAsUser"] == 4242 and security["runAsGroup"] == 4242
    )


def test_fake_mode_node_selection() -> None:
    values = load_values("fake-values") or {}
    values["fakeDevices"]["nodeSelector"] = {"fractional.dev/fake": "true"}
    assert agent_pod(render_chart(values))["nodeSelector"] == {"fractional.dev/fake": "true"}
    values["agent"] = {"nodeSelector": {"pool": "gpu"}}
    assert agent_pod(render_chart(values))["nodeSelector"] == {"pool": "gpu"}


def test_unknown_fake_profile_fails_with_the_shipped_names() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"fakeDevices.profile: \"a100\" is not shipped.*h100-8x"):
        render_chart({"fakeDevices": {"enabled": True, "profile": "a100"}})


# -- real GPUs ----------------------------------------------------------------------------------


def test_real_mode_defaults_to_gpu_nodes_and_the_driver_root(default: list[dict[str, Any]]) -> None:
    pod = agent_pod(default)
    agent = container(pod, "agent")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # NVML's device nodes come only with privileges when no NVIDIA runtime class injects them.
    assert agent["securityContext"]["privileged"] is True
    env = env_of(agent)
    assert env["FRACTIONAL_BACKEND"] == "nvml"
    assert env["LD_LIBRARY_PATH"] == "/nvidia-lib"
    assert env["FRACTIONAL_SYSFS_ROOT"] == "/host/sys"
    mounts = host_paths(pod, agent)
    assert mounts["/"] == ("/driver-root", True)
    assert mounts["/sys"] == ("/host/sys", True)
    assert mounts["/etc/cdi"] == ("/etc/cdi", True)
    (init,) = pod["initContainers"]
    assert "libnvidia-ml.so.1" in init["args"][0]
    assert host_paths(pod, init)["/"] == ("/driver-root", True)


def test_gpus_claimed_elsewhere_are_withheld_unless_turned_off(default: list[dict[str, Any]]) -> None:
    """Coexistence with NVIDIA's device plugin and DRA driver: the agent withholds by default (no
    variable), ``agent.coexistence.withholdClaimedGPUs=false`` turns it off; either way it may write
    its Warning Event on the Node."""
    assert "FRACTIONAL_WITHHOLD_CLAIMED_GPUS" not in env_of(container(agent_pod(default), "agent"))
    off = render_chart({"agent": {"coexistence": {"withholdClaimedGPUs": False}}})
    assert env_of(container(agent_pod(off), "agent"))["FRACTIONAL_WITHHOLD_CLAIMED_GPUS"] == "false"
    rules = one(default, "ClusterRole", "-agent")["rules"]
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]} in rules


def test_claims_choosing_their_backend_is_one_setting_for_agent_and_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sharing.allowClaimBackendOverride`` reaches both: the agent refuses at prepare and the
    controller never allocates a claim that names its own backend when it is false."""
    downward = {"spec.nodeName": "node-a", "metadata.namespace": NAMESPACE, "metadata.name": "c-0",
                "metadata.uid": "uid-0", "status.podIP": "10.244.0.9"}  # fmt: skip
    for value in (True, False):
        values = {"fakeDevices": {"enabled": True}, "sharing": {"allowClaimBackendOverride": value}}
        objects = render_chart(values)
        agent = parse_cli_env(monkeypatch, "plugin", env_of(container(agent_pod(objects), "agent")), downward)
        controller_pod = one(objects, "Deployment", "-controller")["spec"]["template"]["spec"]
        controller = parse_cli_env(
            monkeypatch, "controller", env_of(container(controller_pod, "controller")), downward
        )
        assert build_plugin_config(agent).allow_claim_backend_override is value
        assert build_controller_config(controller).allow_claim_backend_override is value


def test_runtime_class_mode_is_unprivileged() -> None:
    objects = render_chart(load_values("sharing-none-values"))
    pod = agent_pod(objects)
    agent = container(pod, "agent")
    assert pod["runtimeClassName"] == "nvidia"
    assert "privileged" not in agent["securityContext"]
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = env_of(agent)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "LD_LIBRARY_PATH" not in env
    assert "initContainers" not in pod and "/" not in host_paths(pod, agent)


def test_mps_mode_is_privileged_with_the_driver_binaries() -> None:
    objects = render_chart(load_values("sharing-mps-values"))
    agent = container(agent_pod(objects), "agent")
    assert agent["securityContext"]["privileged"] is True
    env = env_of(agent)
    assert env["FRACTIONAL_SHARING"] == "mps"
    assert env["FRACTIONAL_MPS_CONTROL"] == "/driver-root/usr/bin/nvidia-cuda-mps-control"
    assert env["PATH"].endswith(":/driver-root/usr/bin") and env["PATH"].startswith("/opt/venv/bin:")
    assert host_paths(agent_pod(objects), agent)["/run/nvidia/driver"] == ("/driver-root", True)
    # The privileged mode can be turned off explicitly (e.g. a cluster policy forbids it).
    values = load_values("sharing-mps-values") or {}
    values["agent"] = {"privileged": False}
    agent = container(agent_pod(render_chart(values)), "agent")
    assert "privileged" not in agent["securityContext"]


def test_hami_mode_mounts_the_library_and_can_chown_sockets() -> None:
    objects = render_chart(load_values("sharing-hami-values"))
    pod = agent_pod(objects)
    agent = container(pod, "agent")
    env = env_of(agent)
    assert env["FRACTIONAL_HAMI_LIBRARY"] == "/usr/local/vgpu/libvgpu.so"
    assert host_paths(pod, agent)["/usr/local/vgpu/libvgpu.so"] == ("/usr/local/vgpu/libvgpu.so", True)
    assert env["FRACTIONAL_SOCKET_GROUP"] == "2000"
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert "privileged" not in agent["securityContext"]


# -- controller, classes, policy ----------------------------------------------------------------


def test_controller_is_replicated_with_leader_election(default: list[dict[str, Any]]) -> None:
    deployment = one(default, "Deployment", "-controller")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    controller = container(pod, "controller")
    assert controller["args"] == ["controller"]
    env = env_of(controller)
    assert env["FRACTIONAL_LEADER_ELECT"] == "true"
    assert env["FRACTIONAL_LEASE_NAMESPACE"] == ("fieldRef", "metadata.namespace")
    assert env["FRACTIONAL_IDENTITY"] == ("fieldRef", "metadata.name")
    assert controller["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert controller["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    service = one(default, "Service", "-controller-metrics")
    assert str(service["spec"]["ports"][0]["port"]) == env["FRACTIONAL_METRICS_PORT"]
    role = one(default, "Role", "-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"][1]["resourceNames"] == ["fractional-dra-controller"]
    assert env["FRACTIONAL_LEASE_NAME"] == "fractional-dra-controller"


@pytest.mark.parametrize(
    ("values", "qps", "burst"),
    [(None, 50.0, 100), ({"kubeAPIQPS": 12.5, "kubeAPIBurst": 30}, 12.5, 30), ({"kubeAPIQPS": 0}, 0.0, 100)],
)
def test_controller_rate_limit_reaches_the_cli(
    values: dict[str, Any] | None, qps: float, burst: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """controller.kubeAPIQPS / kubeAPIBurst become --kube-api-qps / --kube-api-burst (their env twins)."""
    objects = render_chart({"controller": values} if values else None)
    controller_pod = one(objects, "Deployment", "-controller")["spec"]["template"]["spec"]
    downward = {"metadata.namespace": NAMESPACE, "metadata.name": "c-0", "status.podIP": "10.0.0.1"}
    args = parse_cli_env(monkeypatch, "controller", env_of(container(controller_pod, "controller")), downward)
    config = build_controller_config(args)
    assert (config.kube_api_qps, config.kube_api_burst) == (qps, burst)


def test_flowschema_files_the_controller_where_kube_scheduler_is(default: list[dict[str, Any]]) -> None:
    flow_schema = one(default, "FlowSchema", "-controller")
    assert flow_schema["apiVersion"] == "flowcontrol.apiserver.k8s.io/v1"
    spec = flow_schema["spec"]
    # kube-apiserver's suggested FlowSchema "kube-scheduler": workload-high, flows by namespace.
    assert spec["priorityLevelConfiguration"] == {"name": "workload-high"}
    assert spec["distinguisherMethod"] == {"type": "ByNamespace"}
    # Matched before service-accounts (9000, workload-low), after the system schemas (up to 900).
    assert 900 < spec["matchingPrecedence"] < 9000
    (rule,) = spec["rules"]
    account = one(default, "ServiceAccount", "-controller")["metadata"]
    deployment = one(default, "Deployment", "-controller")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    assert rule["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": {"name": account["name"], "namespace": NAMESPACE}}
    ]
    everything = {
        "verbs": ["*"],
        "apiGroups": ["*"],
        "resources": ["*"],
        "namespaces": ["*"],
        "clusterScope": True,
    }
    assert rule["resourceRules"] == [everything]
    assert rule["nonResourceRules"] == [{"verbs": ["*"], "nonResourceURLs": ["*"]}]


def test_flowschema_can_be_tuned_or_left_out() -> None:
    tuned = render_chart(
        {"controller": {"flowSchema": {"priorityLevel": "ml-schedulers", "matchingPrecedence": 850}}}
    )
    spec = one(tuned, "FlowSchema")["spec"]
    assert (
        spec["priorityLevelConfiguration"] == {"name": "ml-schedulers"} and spec["matchingPrecedence"] == 850
    )
    for values in ({"controller": {"flowSchema": {"enabled": False}}}, {"controller": {"enabled": False}}):
        assert not [o for o in render_chart(values) if o["kind"] == "FlowSchema"], values


def test_two_controllers_without_leader_election_are_refused() -> None:
    with pytest.raises(helm.HelmRenderError, match="leaderElection"):
        render_chart({"controller": {"leaderElection": {"enabled": False}}})
    objects = render_chart({"controller": {"replicas": 1, "leaderElection": {"enabled": False}}})
    kinds = {o["kind"] for o in objects}
    assert "PodDisruptionBudget" not in kinds
    assert not [
        o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-leader-election")
    ]


def test_service_monitor_only_when_enabled(default: list[dict[str, Any]]) -> None:
    assert not [o for o in default if o["kind"] == "ServiceMonitor"]
    monitor = one(render_chart(load_values("sharing-mps-values")), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    selected = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    assert selected == ["agent", "controller"]


def test_device_classes(default: list[dict[str, Any]]) -> None:
    classes = {o["metadata"]["name"]: o for o in default if o["kind"] == "DeviceClass"}
    assert set(classes) == {"gpu.fractional.dev", "nic.fractional.dev"}
    assert "config" not in classes["gpu.fractional.dev"]["spec"]
    device = {"driver": "fractional.dev", "attributes": {"fractional.dev": {"type": "gpu"}}}
    other = {"driver": "gpu.nvidia.com", "attributes": {"fractional.dev": {"type": "gpu"}}}
    nic = {"driver": "fractional.dev", "attributes": {"fractional.dev": {"type": "nic"}}}
    (gpu_selector,) = classes["gpu.fractional.dev"]["spec"]["selectors"]
    (nic_selector,) = classes["nic.fractional.dev"]["spec"]["selectors"]
    assert [cel.evaluate(gpu_selector["cel"]["expression"], {"device": d}) for d in (device, other, nic)] == [
        True,
        False,
        False,
    ]
    assert [cel.evaluate(nic_selector["cel"]["expression"], {"device": d}) for d in (device, other, nic)] == [
        False,
        False,
        True,
    ]


def test_class_level_gpu_config() -> None:
    objects = render_chart(load_values("sharing-mps-values"))
    gpu_class = next(o for o in objects if o["metadata"]["name"] == "gpu.fractional.dev")
    assert gpu_class["spec"]["config"] == [
        {
            "opaque": {
                "driver": "fractional.dev",
                "parameters": {
                    "apiVersion": "fractional.dev/v1alpha1",
                    "kind": "GpuConfig",
                    "sharing": {"backend": "mps", "mps": {"defaultActiveThreadPercentage": 50}},
                },
            }
        }
    ]


def test_admission_policy_pins_the_agent_to_its_node(default: list[dict[str, Any]]) -> None:
    policy = one(default, "ValidatingAdmissionPolicy", "-resourceslices")
    binding = one(default, "ValidatingAdmissionPolicyBinding", "-resourceslices")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"] and set(rule["operations"]) == {
        "CREATE",
        "UPDATE",
        "DELETE",
    }
    account = one(default, "ServiceAccount", "-agent")["metadata"]["name"]
    (condition,) = spec["matchConditions"]
    assert f'"system:serviceaccount:{NAMESPACE}:{account}"' in condition["expression"]
    assert "authentication.kubernetes.io/node-name" in spec["variables"][0]["expression"]

    # The validations, evaluated for (node of the agent, node of the slice, its driver, its pool);
    # tests/chart/test_policies.py evaluates the whole policy on requests.
    def allowed(user_node: str, object_node: str, driver: str = "fractional.dev", pool: str = "") -> bool:
        variables = {
            "userNodeName": user_node,
            "objectNodeName": object_node,
            "driver": "fractional.dev",
            "objectDrivers": [driver],
            "objectPools": [pool or object_node],
        }
        context = {"variables": variables}
        return all(cel.evaluate(v["expression"], copy.deepcopy(context)) for v in spec["validations"])

    assert allowed("node-a", "node-a")
    assert not allowed("node-a", "node-b")
    assert not allowed("node-a", "")
    assert not allowed("", "")
    assert not allowed("node-a", "node-a", driver="gpu.nvidia.com")
    assert not allowed("node-a", "node-a", pool="node-b")


def test_notes_name_the_mode() -> None:
    assert "fake devices, profile h100-8x" in render_notes(load_values("fake-values"))
    notes = render_notes(None)
    assert "real GPUs through NVML" in notes and "nvidia.com/gpu" in notes


def test_chart_device_classes_select_what_the_code_assumes() -> None:
    """The demo, `fractional plan` and the scale-up hints use driver.slices.build_device_classes();
    the chart's classes must select exactly the same devices."""
    from driver.slices import build_device_classes

    rendered = {o["metadata"]["name"]: o for o in render_chart(None) if o["kind"] == "DeviceClass"}
    for expected in build_device_classes():
        name = expected["metadata"]["name"]
        assert rendered[name]["spec"]["selectors"] == expected["spec"]["selectors"], name


def _pod_images(objects: list[dict[str, Any]]) -> set[str]:
    return {
        container["image"]
        for o in objects
        if o["kind"] in ("DaemonSet", "Deployment")
        for container in [
            *o["spec"]["template"]["spec"].get("initContainers", []),
            *o["spec"]["template"]["spec"]["containers"],
        ]
    }


def test_default_image_is_what_make_image_builds() -> None:
    """No release image is published yet: by default the chart runs `make image`'s (the Makefile's
    IMAGE); a release's chart empties the tag, which then is the appVersion."""
    make_image = next(
        line.split("?=", 1)[1].strip()
        for line in (REPO_ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
        if line.startswith("IMAGE ?=")
    )
    assert make_image == "fractional-dra:dev"
    assert _pod_images(render_chart(None)) == {make_image}
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))["appVersion"]
    released = render_chart({"image": {"repository": "ghcr.io/example/fractional-dra", "tag": ""}})
    assert _pod_images(released) == {f"ghcr.io/example/fractional-dra:{app_version}"}


def test_the_charts_default_policy_is_the_controllers_own() -> None:
    """fragmentation is the default of the chart, of ``fractional controller`` and of its config."""
    controller_pod = one(render_chart(None), "Deployment", "-controller")["spec"]["template"]["spec"]
    policy = env_of(container(controller_pod, "controller"))["FRACTIONAL_POLICY"]
    assert policy == DEFAULT_POLICY == ControllerConfig().policy == "fragmentation"
    assert _build_parser().parse_args(["controller"]).policy == DEFAULT_POLICY
