{{/* Names and labels shared by every template. */}}

{{- define "fractional-dra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fractional-dra.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fractional-dra.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "fractional-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fractional-dra
{{- end -}}

{{/* Selector labels of one component: include with (dict "root" $ "component" "agent"). */}}
{{- define "fractional-dra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fractional-dra.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fractional-dra.agentName" -}}
{{- printf "%s-agent" (include "fractional-dra.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fractional-dra.controllerName" -}}
{{- printf "%s-controller" (include "fractional-dra.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The allocation guard's Service, Secret (-tls) and webhook configuration; its EndpointSlice is
<name>-leader (driver/controller/guard/endpoint.py). */}}
{{- define "fractional-dra.allocationGuardName" -}}
{{- printf "%s-allocation-guard" (include "fractional-dra.controllerName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fractional-dra.profilesName" -}}
{{- printf "%s-profiles" (include "fractional-dra.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fractional-dra.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the profiles ConfigMap is mounted in both pods. */}}
{{- define "fractional-dra.profilesDir" -}}/etc/fractional-dra/profiles{{- end -}}

{{/* The driver name (docs/architecture.md: Names); fixed, also the plugin directory's name. */}}
{{- define "fractional-dra.driverName" -}}fractional.dev{{- end -}}

{{/* Real GPUs with NVML through the host driver root (no runtime class). */}}
{{- define "fractional-dra.driverRootMode" -}}
{{- if and (not .Values.fakeDevices.enabled) (not .Values.realGpu.runtimeClassName) -}}true{{- end -}}
{{- end -}}

{{/*
Privileged only where the mode needs it: real GPUs with MPS (compute mode, MPS control daemon)
or NVML through the driver-root mount (the /dev/nvidia* device nodes). agent.privileged overrides.
*/}}
{{- define "fractional-dra.agentPrivileged" -}}
{{- if kindIs "bool" .Values.agent.privileged -}}
{{- if .Values.agent.privileged -}}true{{- end -}}
{{- else if not .Values.fakeDevices.enabled -}}
{{- if or (eq .Values.sharing.backend "mps") (include "fractional-dra.driverRootMode" .) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fractional-dra.agentNodeSelector" -}}
{{- if .Values.agent.nodeSelector -}}
{{- toYaml .Values.agent.nodeSelector -}}
{{- else if .Values.fakeDevices.enabled -}}
{{- with .Values.fakeDevices.nodeSelector -}}{{- toYaml . -}}{{- end -}}
{{- else -}}
nvidia.com/gpu.present: "true"
{{- end -}}
{{- end -}}

{{/* Profile names shipped in the chart, sorted. */}}
{{- define "fractional-dra.profileNames" -}}
{{- $names := list -}}
{{- range $path, $_ := .Files.Glob "files/profiles/*.yaml" -}}
{{- $names = append $names (base $path | trimSuffix ".yaml") -}}
{{- end -}}
{{- sortAlpha $names | join "," -}}
{{- end -}}

{{/*
apiServer.host / apiServer.port as the variables in-cluster configuration reads. A container's own
variables override the ones the kubelet injects for the kubernetes Service, so both components
reach the API server without kube-proxy. Renders nothing when apiServer.host is empty.
*/}}
{{- define "fractional-dra.apiServerEnv" -}}
{{- if and (not .Values.apiServer.host) (ne (toString .Values.apiServer.port) "") -}}
{{- fail "apiServer.port needs apiServer.host: without a host the pods use the kubernetes Service" -}}
{{- end -}}
{{- if .Values.apiServer.host -}}
# apiServer.host: in-cluster configuration talks to this address instead of the kubernetes Service.
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ ternary "443" (toString .Values.apiServer.port) (eq (toString .Values.apiServer.port) "") | quote }}
{{- end }}
{{- end -}}

{{/* hostNetwork of one component: include with (dict "enabled" .Values.agent.hostNetwork). */}}
{{- define "fractional-dra.hostNetworkPod" -}}
{{- if .enabled -}}
# On the node's network (no pod network or kube-proxy needed); cluster DNS still first.
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end -}}

{{/* The metrics/probe address on the node's network: the node's IP, not every address of a host
that other nodes may share. Include with (dict "enabled" .Values.agent.hostNetwork). */}}
{{- define "fractional-dra.hostNetworkEnv" -}}
{{- if .enabled -}}
# hostNetwork: serve on the node's IP only; the kubelet probes the pod IP, which is the node's.
- name: FRACTIONAL_METRICS_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end }}
{{- end -}}

{{/* The controller's scheduling gate (driver/controller/model/objects.py GATE). */}}
{{- define "fractional-dra.gateName" -}}fractional.dev/allocation{{- end -}}

{{/* The label that opts a namespace or a pod out of the gate's policy (value "disabled"). */}}
{{- define "fractional-dra.autoGateLabel" -}}fractional.dev/auto-gate{{- end -}}

{{/* A namespace labelled with it =all-pods has its pods without claims gated too (the controller places them). */}}
{{- define "fractional-dra.placementLabel" -}}fractional.dev/placement{{- end -}}

{{/*
The API version of MutatingAdmissionPolicy to install the gate's policy with, or nothing:
autoGate.apiVersion when set; else v1 from Kubernetes 1.36 (or wherever the cluster serves it),
v1beta1 where the cluster serves that, otherwise none.
*/}}
{{- define "fractional-dra.autoGateAPIVersion" -}}
{{- $v1 := "admissionregistration.k8s.io/v1" -}}
{{- $beta := "admissionregistration.k8s.io/v1beta1" -}}
{{- if .Values.autoGate.apiVersion -}}
{{- .Values.autoGate.apiVersion -}}
{{- else if or (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version) (.Capabilities.APIVersions.Has (printf "%s/MutatingAdmissionPolicy" $v1)) -}}
{{- $v1 -}}
{{- else if .Capabilities.APIVersions.Has (printf "%s/MutatingAdmissionPolicy" $beta) -}}
{{- $beta -}}
{{- end -}}
{{- end -}}
