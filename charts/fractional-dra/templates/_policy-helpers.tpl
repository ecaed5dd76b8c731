{{/*
CEL building blocks of the ValidatingAdmissionPolicies (validatingadmissionpolicy*.yaml).

The expressions use has(), dyn(), macros and plain map access only: no optional syntax (.?,
[?]) and no cel.bind, so tests/chart/test_policies.py can evaluate them with the Python CEL
interpreter exactly as written. kube-apiserver hands a policy `object`, `oldObject` and `request`
as plain maps converted from the typed objects (empty fields left out, like JSON omitempty), so
every optional field is guarded by has() before it is read.
*/}}

{{/* The username of a component's service account: include with (dict "root" $ "name" <sa name>). */}}
{{- define "fractional-dra.policy.username" -}}
system:serviceaccount:{{ .root.Release.Namespace }}:{{ .name }}
{{- end -}}

{{/*
The node the requesting pod runs on, '' when unknown. Service account tokens bound to a pod carry
the pod's node in the user extra "authentication.kubernetes.io/node-name"
(ServiceAccountTokenPodNodeInfo: beta and on in 1.30, GA in 1.32; constant
serviceaccount.NodeNameKey). Exactly one value, as upstream's saAssociatedWithAllocatedNode
(pkg/registry/resource/utils.go) requires.
*/}}
{{- define "fractional-dra.policy.userNodeNameVariables" -}}
- name: userNodeNames
  expression: >-
    has(request.userInfo.extra) &&
    'authentication.kubernetes.io/node-name' in request.userInfo.extra ?
    request.userInfo.extra['authentication.kubernetes.io/node-name'] : []
- name: userNodeName
  expression: >-
    size(variables.userNodeNames) == 1 ? variables.userNodeNames[0] : ''
{{- end -}}

{{/*
Metadata the API server itself sets on every write (the client may not choose them, or they
always move): allowed to differ between oldObject and object.
*/}}
{{- define "fractional-dra.policy.serverMetadata" -}}
['resourceVersion', 'generation', 'managedFields']
{{- end -}}

{{/*
"The maps new and old are equal except for the keys in except", as one CEL expression:
include with (dict "new" "object.spec" "old" "oldObject.spec" "except" "['schedulingGates']").
A key added, removed or changed outside except makes it false. dyn() lets the expression range
over a typed object's fields (kube-apiserver's type check would otherwise warn).
*/}}
{{- define "fractional-dra.policy.unchangedExcept" -}}
dyn({{ .new }}).all(k, k in {{ .except }} || (k in dyn({{ .old }}) && dyn({{ .new }})[k] == dyn({{ .old }})[k])) &&
dyn({{ .old }}).all(k, k in {{ .except }} || k in dyn({{ .new }}))
{{- end -}}
