"""``pods/log`` of the embedded API emulator (a test double): what kube-apiserver and the kubelet
answer, for pods whose containers no process runs.

kube-apiserver (``pkg/registry/core/pod/rest/log.go``, ``LogLocation``) picks the container (the only
one, else the request must name one) and answers 204 No Content for a pod not bound to a node; the
kubelet (``pkg/kubelet/kubelet_pods.go``, ``validateContainerLogStatus``) then refuses a container
that has not started with 400 and says why, from the container's status. Departure: no container
runs here (the demo's kubelet stand-in only reports them running), so a started container's log
is empty, as that of a container that has printed nothing.
"""

from __future__ import annotations

from typing import Any

from driver.cluster.apiserver.store import StatusError

__all__ = ["pod_log"]

Obj = dict[str, Any]

# kubelet's messages for the common waiting reasons (pkg/kubelet/images: ErrImagePull, ErrImagePullBackOff).
_WAITING = {
    "ErrImagePull": "image can't be pulled",
    "ImagePullBackOff": "trying and failing to pull image",
}


def _bad_request(message: str) -> StatusError:
    return StatusError(code=400, reason="BadRequest", message=message)


def _names(containers: Any) -> list[str]:
    return [str(c.get("name", "")) for c in containers or ()]


def _container(pod: Obj, requested: str) -> str:
    spec = pod.get("spec") or {}
    name = pod["metadata"]["name"]
    containers = _names(spec.get("containers"))
    if not requested:
        if len(containers) == 1:
            return containers[0]
        if not containers:
            raise _bad_request(f"a container name must be specified for pod {name}")
        message = (
            f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
        )
        if init := _names(spec.get("initContainers")):
            message += f" or one of the init containers: [{' '.join(init)}]"
        raise _bad_request(message)
    every = containers + _names(spec.get("initContainers")) + _names(spec.get("ephemeralContainers"))
    if requested not in every:
        raise _bad_request(f"container {requested} is not valid for pod {name}")
    return requested


def _container_status(pod: Obj, container: str) -> Obj | None:
    status = pod.get("status") or {}
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for entry in status.get(key) or ():
            if entry.get("name") == container:
                return dict(entry)
    return None


def pod_log(pod: Obj, query: dict[str, str]) -> tuple[int, str]:
    """(status code, log text) of ``GET .../pods/<name>/log`` with ``query``; raise 400 as upstream."""
    container = _container(pod, query.get("container", ""))
    if not (pod.get("spec") or {}).get("nodeName"):
        return 204, ""  # not bound: kube-apiserver has no kubelet to ask
    name = pod["metadata"]["name"]
    status = _container_status(pod, container)
    if status is None:
        raise _bad_request(f'container "{container}" in pod "{name}" is not available')
    state = status.get("state") or {}
    last = (status.get("lastState") or {}).get("terminated")
    if query.get("previous") in ("true", "1"):
        if not last:
            raise _bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
        return 200, ""
    if state.get("running") or state.get("terminated") or last:
        return 200, ""
    waiting = state.get("waiting")
    if waiting is not None:
        reason = str(waiting.get("reason", ""))
        raise _bad_request(
            f'container "{container}" in pod "{name}" is waiting to start: {_WAITING.get(reason, reason)}'
        )
    raise _bad_request(f'container "{container}" in pod "{name}" is waiting to start - no logs yet')
