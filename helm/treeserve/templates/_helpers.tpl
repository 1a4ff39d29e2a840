{{/* Names and labels. */}}
{{- define "treeserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "treeserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Labels of the chart's own objects (Services, Secrets, ServiceMonitor, the test pod): the usual
app.kubernetes.io set.
*/}}
{{- define "treeserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "treeserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "treeserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "treeserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels of the Ray pods. Never app.kubernetes.io/name or app.kubernetes.io/created-by: KubeRay labels every
Ray pod app.kubernetes.io/name=kuberay, app.kubernetes.io/created-by=kuberay-operator and selects the head
pod on those in the head Service it makes for a RayService (<fullname>-head-svc, the dashboard's); a pod
template that overrides them leaves that Service with no endpoints (ray-operator common/pod.go labelPod,
common/service.go HeadServiceLabels). The chart's Services select Ray pods on these instead, together
with KubeRay's own ray.io/node-type and ray.io/group, which no template can override.
*/}}
{{- define "treeserve.rayPodSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "treeserve.name" . }}
{{- end }}

{{/* KubeRay minimum version: what the chart relies on (RayService ray.io/v1 with workerGroupSpecs.numOfHosts). */}}
{{- define "treeserve.kuberayMinVersion" -}}1.1.0{{- end }}

{{/*
On a live install/upgrade, read the cluster's RayService CRD and require KubeRay >= 1.1.0: its schema has
workerGroupSpecs[].numOfHosts since 1.1.0 (earlier CRDs would prune fields and their operators restart a
RayService whose model takes long to load). `helm template` has no cluster: lookup returns nothing, no check.
*/}}
{{- define "treeserve.checkKuberay" -}}
{{- if .Values.kuberay.verifyVersion }}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "rayservices.ray.io" }}
{{- if $crd }}
{{- $v1 := dict }}
{{- range $crd.spec.versions }}{{ if eq .name "v1" }}{{ $v1 = . }}{{ end }}{{ end }}
{{- if not $v1 }}
{{- fail (printf "the cluster's RayService CRD has no ray.io/v1 version: install KubeRay >= %s (or set kuberay.verifyVersion=false)" (include "treeserve.kuberayMinVersion" .)) }}
{{- end }}
{{- $groups := dig "schema" "openAPIV3Schema" "properties" "spec" "properties" "rayClusterConfig" "properties" "workerGroupSpecs" "items" "properties" dict $v1 }}
{{- if not (hasKey $groups "numOfHosts") }}
{{- fail (printf "the cluster's RayService CRD is older than KubeRay %s (no workerGroupSpecs.numOfHosts): upgrade the KubeRay operator and its CRDs (or set kuberay.verifyVersion=false)" (include "treeserve.kuberayMinVersion" .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Parse a CPU quantity ("2", "1.5", "500m") into millicores. */}}
{{- define "treeserve.millicores" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}{{ trimSuffix "m" $q | int }}{{ else }}{{ mulf (float64 $q) 1000 | int }}{{ end }}
{{- end }}

{{/* Ray CPUs of a worker group's pod: its CPU limit (else request), whole CPUs (what `ray start --num-cpus` takes). */}}
{{- define "treeserve.podCpus" -}}
{{- $r := .resources }}
{{- $cpu := dig "limits" "cpu" (dig "requests" "cpu" "0" $r) $r }}
{{- div (include "treeserve.millicores" $cpu | int) 1000 }}
{{- end }}

{{/*
Placement. Every replica asks for a custom Ray resource that only the pods meant for it advertise
(rayStartParams resources), so none can take GPUs or CPUs another needs:
  TreeServeTarget: 1 per target pod (the target replica's coordinator bundle; its ranks follow, STRICT_PACK)
  TreeServeDrafter: 1 per target pod with placement.drafter=targetWorkers, draftersPerPod per drafter pod
  TreeServeRouter: routersPerPod per pod of placement.router's group
*/}}
{{- /* A drafter model is configured: drafter.path "none", or no drafter section at all (`drafter: null`), means
copy-from-context drafting alone, in the Router (services/config DrafterConfig.has_model): no Drafter deployment,
and no pod, GPU, CPU or Ray resource is set aside for one. */}}
{{- define "treeserve.hasDrafter" -}}{{ with .Values.drafter }}{{ if ne (toString .path) "none" }}true{{ end }}{{ end }}{{- end }}
{{- define "treeserve.drafterOnTarget" -}}{{ if and (include "treeserve.hasDrafter" .) (eq .Values.placement.drafter "targetWorkers") }}true{{ end }}{{- end }}
{{- define "treeserve.drafterOnDrafterWorkers" -}}{{ if and (include "treeserve.hasDrafter" .) (eq .Values.placement.drafter "drafterWorkers") }}true{{ end }}{{- end }}
{{- define "treeserve.routerOnTarget" -}}{{ if eq .Values.placement.router "targetWorkers" }}true{{ end }}{{- end }}
{{- /* The drafterWorkers group exists when something is placed there: drafters, routers or both. */}}
{{- define "treeserve.drafterGroupEnabled" -}}
{{- if or (include "treeserve.drafterOnDrafterWorkers" .) (eq .Values.placement.router "drafterWorkers") }}true{{ end }}
{{- end }}
{{- define "treeserve.routerGroup" -}}{{ ternary "target" "drafter" (eq .Values.placement.router "targetWorkers") }}{{- end }}

{{/* GPU share of each target rank (JSON list): 1 each, the last one 1 - serve.drafter.numGpus when the drafter shares it. */}}
{{- define "treeserve.rankShares" -}}
{{- $tp := int .Values.target.tensorParallelSize }}
{{- $shares := list }}
{{- range $i := until $tp }}
{{- $share := 1.0 }}
{{- if and (eq $i (sub $tp 1)) (include "treeserve.drafterOnTarget" $) (eq $.Values.drafter.device "cuda") }}
{{- $share = round (subf 1.0 (float64 $.Values.serve.drafter.numGpus)) 4 }}
{{- end }}
{{- $shares = append $shares $share }}
{{- end }}
{{- toJson $shares }}
{{- end }}

{{/* Custom Ray resources a worker group's pods advertise (JSON object). */}}
{{- define "treeserve.groupResources" -}}
{{- $v := .root.Values }}
{{- $res := dict }}
{{- if eq .group "target" }}
{{- $_ := set $res "TreeServeTarget" 1 }}
{{- if include "treeserve.drafterOnTarget" .root }}{{ $_ := set $res "TreeServeDrafter" 1 }}{{ end }}
{{- if eq $v.placement.router "targetWorkers" }}{{ $_ := set $res "TreeServeRouter" (int $v.placement.routersPerPod) }}{{ end }}
{{- else }}
{{- if include "treeserve.drafterOnDrafterWorkers" .root }}{{ $_ := set $res "TreeServeDrafter" (int $v.placement.draftersPerPod) }}{{ end }}
{{- if eq $v.placement.router "drafterWorkers" }}{{ $_ := set $res "TreeServeRouter" (int $v.placement.routersPerPod) }}{{ end }}
{{- end }}
{{- toJson $res }}
{{- end }}

{{/* GPUs of a worker group's pod. */}}
{{- define "treeserve.groupGpus" -}}
{{- if eq .group "target" }}{{ if eq .root.Values.target.device "cuda" }}{{ int .root.Values.target.tensorParallelSize }}{{ else }}0{{ end }}
{{- else }}{{ int .root.Values.ray.drafterWorkers.gpus }}{{ end }}
{{- end }}

{{/* Ray CPUs the replicas placed on one pod of a group may ask for together (millicores). */}}
{{- define "treeserve.groupCpuDemand" -}}
{{- $v := .root.Values }}
{{- $m := 0 }}
{{- if eq .group "target" }}
{{- $m = include "treeserve.millicores" $v.serve.target.numCpus | int }}
{{- if gt (int $v.target.tensorParallelSize) 1 }}
{{- $m = add $m (mul (include "treeserve.millicores" $v.serve.target.cpusPerRank | int) (int $v.target.tensorParallelSize)) }}
{{- end }}
{{- if include "treeserve.drafterOnTarget" .root }}{{ $m = add $m (include "treeserve.millicores" $v.serve.drafter.numCpus | int) }}{{ end }}
{{- if eq $v.placement.router "targetWorkers" }}{{ $m = add $m (mul (include "treeserve.millicores" $v.serve.router.numCpus | int) (int $v.placement.routersPerPod)) }}{{ end }}
{{- else }}
{{- if include "treeserve.drafterOnDrafterWorkers" .root }}{{ $m = add $m (mul (include "treeserve.millicores" $v.serve.drafter.numCpus | int) (int $v.placement.draftersPerPod)) }}{{ end }}
{{- if eq $v.placement.router "drafterWorkers" }}{{ $m = add $m (mul (include "treeserve.millicores" $v.serve.router.numCpus | int) (int $v.placement.routersPerPod)) }}{{ end }}
{{- end }}
{{- $m }}
{{- end }}

{{/*
Fail fast on layouts that cannot start: the schema checks types and ranges, these check relations
between values (a TP size that does not divide the heads would only fail once the weights are loaded; a
replica with no pod to land on would stay pending forever).
*/}}
{{- define "treeserve.checks" -}}
{{- $v := .Values }}
{{- $t := $v.target }}
{{- $tp := int $t.tensorParallelSize }}
{{- range $key := list "numAttentionHeads" "numKeyValueHeads" }}
{{- $heads := index $t $key }}
{{- if and $heads (mod (int $heads) $tp) }}
{{- fail (printf "target.tensorParallelSize=%d must divide target.%s=%d" $tp $key (int $heads)) }}
{{- end }}
{{- end }}
{{- $drafter := include "treeserve.hasDrafter" . }}
{{- $roles := ternary (list "target" "drafter") (list "target") (not (empty $drafter)) }}
{{- if not $drafter }}
{{- if not (has $v.speculation.method (list "lookup" "autoregressive")) }}
{{- fail (printf "speculation.method=%s drafts with a drafter model, and there is none (drafter.path=none or no drafter section): use lookup (copies from the context) or autoregressive, or configure a drafter" $v.speculation.method) }}
{{- end }}
{{- end }}
{{- range $role := $roles }}
{{- $m := index $v $role }}
{{- /* models shipped in the image: the target "default", its drafters "eagle3", "eagle", "distilled" and
"parallel" ("default": the deprecated name of "distilled") */}}
{{- $embedded := ternary (list "eagle3" "eagle" "distilled" "parallel" "default") (list "default") (eq $role "drafter") }}
{{- if and (not (has $m.path $embedded)) (not (hasPrefix (printf "%s/" (trimSuffix "/" $v.modelVolume.mountPath)) $m.path)) }}
{{- fail (printf "%s.path=%s must be one of %s or a directory under modelVolume.mountPath=%s" $role $m.path (join ", " $embedded) $v.modelVolume.mountPath) }}
{{- end }}
{{- if and (not (has $m.path $embedded)) (eq $v.modelVolume.type "none") }}
{{- fail (printf "%s.path=%s needs a model volume: set modelVolume.type to pvc or hostPath" $role $m.path) }}
{{- end }}
{{- if and $m.maxSessions (lt (int $m.maxSessions) (int $v.limits.maxBatchSize)) }}
{{- fail (printf "%s.maxSessions=%d is below limits.maxBatchSize=%d: a full batch on one replica could never be scored" $role (int $m.maxSessions) (int $v.limits.maxBatchSize)) }}
{{- end }}
{{- end }}
{{- /* GPUs (a drafter's only when there is one: without, serve.drafter and drafter.device are unused) */}}
{{- $dg := float64 $v.serve.drafter.numGpus }}
{{- if not $drafter }}
{{- else if eq $v.drafter.device "cuda" }}
{{- if le $dg 0.0 }}
{{- fail "drafter.device=cuda needs serve.drafter.numGpus > 0 (a GPU, or a share of one)" }}
{{- end }}
{{- if and (gt $dg 1.0) (ne $dg (float64 (int $dg))) }}
{{- fail (printf "serve.drafter.numGpus=%v: above 1 it must be a whole number" $v.serve.drafter.numGpus) }}
{{- end }}
{{- if include "treeserve.drafterOnTarget" . }}
{{- if or (ne $t.device "cuda") (ge $dg 1.0) }}
{{- fail "placement.drafter=targetWorkers with drafter.device=cuda shares a target GPU: needs target.device=cuda and 0 < serve.drafter.numGpus < 1" }}
{{- end }}
{{- $targetShare := subf 1.0 $dg }}
{{- if or (not $t.gpuMemoryFraction) (gt (float64 $t.gpuMemoryFraction) (addf $targetShare 0.000001)) }}
{{- fail (printf "target.gpuMemoryFraction must be set and at most %v: the last target rank keeps 1 - serve.drafter.numGpus of its GPU" (round $targetShare 4)) }}
{{- end }}
{{- if or (not $v.drafter.gpuMemoryFraction) (gt (float64 $v.drafter.gpuMemoryFraction) (addf $dg 0.000001)) }}
{{- fail (printf "drafter.gpuMemoryFraction must be set and at most serve.drafter.numGpus=%v (its share of the GPU it shares)" $v.serve.drafter.numGpus) }}
{{- end }}
{{- else }}
{{- $need := mulf $dg (float64 $v.placement.draftersPerPod) }}
{{- if gt $need (float64 $v.ray.drafterWorkers.gpus) }}
{{- fail (printf "placement.draftersPerPod=%d drafters x serve.drafter.numGpus=%v need %v GPUs per drafter pod, ray.drafterWorkers.gpus=%d" (int $v.placement.draftersPerPod) $v.serve.drafter.numGpus $need (int $v.ray.drafterWorkers.gpus)) }}
{{- end }}
{{- if and (lt $dg 1.0) (or (not $v.drafter.gpuMemoryFraction) (gt (float64 $v.drafter.gpuMemoryFraction) (addf $dg 0.000001))) }}
{{- fail (printf "drafter.gpuMemoryFraction must be set and at most serve.drafter.numGpus=%v when drafters share a GPU" $v.serve.drafter.numGpus) }}
{{- end }}
{{- end }}
{{- else if gt $dg 0.0 }}
{{- fail "serve.drafter.numGpus > 0 needs drafter.device=cuda" }}
{{- end }}
{{- /* Replicas vs the pods that can hold them (one target replica per target pod). */}}
{{- $tw := $v.ray.targetWorkers }}
{{- if gt (int $v.serve.target.maxReplicas) (int $tw.maxReplicas) }}
{{- fail (printf "serve.target.maxReplicas=%d exceeds ray.targetWorkers.maxReplicas=%d: each target replica needs a target pod of its own" (int $v.serve.target.maxReplicas) (int $tw.maxReplicas)) }}
{{- end }}
{{- range $d := ternary (list "drafter" "router") (list "router") (not (empty $drafter)) }}
{{- $where := index $v.placement $d }}
{{- $pods := int (index $v.ray $where).maxReplicas }}
{{- $per := ternary 1 (int (index $v.placement (printf "%ssPerPod" $d))) (and (eq $d "drafter") (eq $where "targetWorkers")) }}
{{- $max := int (index $v.serve $d).maxReplicas }}
{{- if gt $max (mul $pods $per) }}
{{- fail (printf "serve.%s.maxReplicas=%d exceeds what placement.%s=%s holds: ray.%s.maxReplicas=%d pods x %d per pod" $d $max $d $where $where $pods $per) }}
{{- end }}
{{- end }}
{{- range $key := list "replicas" "minReplicas" }}
{{- range $g := list "targetWorkers" "drafterWorkers" }}
{{- $w := index $v.ray $g }}
{{- if or (gt (int (index $w $key)) (int $w.maxReplicas)) (gt (int $w.minReplicas) (int $w.replicas)) }}
{{- fail (printf "ray.%s: needs minReplicas <= replicas <= maxReplicas (got %d, %d, %d)" $g (int $w.minReplicas) (int $w.replicas) (int $w.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $d := list "router" "drafter" "target" }}
{{- $s := index $v.serve $d }}
{{- if gt (int $s.minReplicas) (int $s.maxReplicas) }}
{{- fail (printf "serve.%s.minReplicas=%d exceeds maxReplicas=%d" $d (int $s.minReplicas) (int $s.maxReplicas)) }}
{{- end }}
{{- end }}
{{- /* CPUs: what the replicas placed on one pod ask for must fit the pod's Ray CPUs. */}}
{{- $groups := list "target" }}
{{- if include "treeserve.drafterGroupEnabled" . }}{{ $groups = append $groups "drafter" }}{{ end }}
{{- range $g := $groups }}
{{- $w := index $v.ray (printf "%sWorkers" $g) }}
{{- $have := mul (include "treeserve.podCpus" $w | int) 1000 }}
{{- $need := include "treeserve.groupCpuDemand" (dict "root" $ "group" $g) | int }}
{{- if gt $need $have }}
{{- fail (printf "ray.%sWorkers pods have %d Ray CPUs (resources.limits.cpu) but the replicas placed there ask for %.2f" $g (div $have 1000) (divf $need 1000.0)) }}
{{- end }}
{{- end }}
{{- /* The OpenAI-compatible HTTP API shares the router pods with the gRPC API, Serve's proxy and Ray's metrics. */}}
{{- with $v.api.httpPort }}
{{- range $name, $port := dict "api.port" $v.api.port "serve.httpPort" $v.serve.httpPort "ray.metricsPort" $v.ray.metricsPort }}
{{- if eq (int $port) (int $.Values.api.httpPort) }}
{{- fail (printf "api.httpPort=%d is %s's port too: the HTTP API needs a port of its own on the router pods" (int $.Values.api.httpPort) $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Security */}}
{{- if and (not $v.security.tls.enabled) (not $v.security.allowInsecure) }}
{{- fail "security.tls.enabled=false serves the API in plaintext on the pod network: keep TLS on, or set security.allowInsecure=true when TLS is terminated in front of the pods" }}
{{- end }}
{{- if and $v.security.tls.enabled (not $v.security.tls.secretName) (not $v.security.tls.generate) }}
{{- fail "security.tls.enabled needs security.tls.secretName (a kubernetes.io/tls Secret) or security.tls.generate=true" }}
{{- end }}
{{- if and $v.ingress.enabled (not $v.ingress.tls.enabled) }}
{{- fail "ingress.enabled needs ingress.tls.enabled: the Ingress would carry the API and its bearer tokens in plaintext" }}
{{- end }}
{{- if and $v.ingress.enabled $v.ingress.tls.enabled (not $v.ingress.tls.secretName) }}
{{- fail "ingress.tls.enabled needs ingress.tls.secretName" }}
{{- end }}
{{- if and (eq $v.modelVolume.type "pvc") (not $v.modelVolume.claimName) }}
{{- fail "modelVolume.type=pvc needs modelVolume.claimName" }}
{{- end }}
{{- if and (eq $v.modelVolume.type "hostPath") (not $v.modelVolume.hostPath) }}
{{- fail "modelVolume.type=hostPath needs modelVolume.hostPath" }}
{{- end }}
{{- range $k, $_ := $v.podLabels }}
{{- if has $k (list "app.kubernetes.io/name" "app.kubernetes.io/created-by") }}
{{- fail (printf "podLabels.%s: KubeRay's head Service selects the head pod on this label; overriding it leaves the dashboard Service without endpoints" $k) }}
{{- end }}
{{- end }}
{{- include "treeserve.checkKuberay" . }}
{{- end }}

{{/* Secret names and mount paths of the API's TLS certificate and tokens (deploy/*.yaml use the same paths). */}}
{{- define "treeserve.tlsSecret" -}}{{ .Values.security.tls.secretName | default (printf "%s-tls" (include "treeserve.fullname" .)) }}{{- end }}
{{- define "treeserve.authSecret" -}}{{ .Values.security.auth.secretName | default (printf "%s-auth" (include "treeserve.fullname" .)) }}{{- end }}
{{- define "treeserve.tlsDir" -}}/etc/treeserve/tls{{- end }}
{{- define "treeserve.authDir" -}}/etc/treeserve/auth{{- end }}

{{/* A model section of the app args (services/config/models.py ModelConfig / DrafterConfig). */}}
{{- define "treeserve.modelArgs" -}}
path: {{ .m.path | toJson }}
dtype: {{ .m.dtype }}
device: {{ .m.device }}
max_context_tokens: {{ int .m.maxContextTokens }}
{{- with .m.maxSessions }}
max_sessions: {{ int . }}
{{- end }}
{{- with .m.gpuMemoryFraction }}
gpu_memory_fraction: {{ . }}
{{- end }}
cuda_graphs: {{ .m.cudaGraphs }}
fused_ops: {{ .m.fusedOps }}
graph_memory_mib: {{ int .m.graphMemoryMib }}
{{- if .target }}
tensor_parallel_size: {{ int .m.tensorParallelSize }}
{{- with .m.numAttentionHeads }}
num_attention_heads: {{ int . }}
{{- end }}
{{- with .m.numKeyValueHeads }}
num_key_value_heads: {{ int . }}
{{- end }}
{{- with .m.chatTemplate }}
chat_template: {{ . | toJson }}
{{- end }}
{{- else }}
kind: {{ .m.kind }}
{{- with .m.layout }}
layout: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* One Serve deployment override (services/config/serve_file.py DeploymentConfig). */}}
{{- define "treeserve.deployment" -}}
- name: {{ .name }}
  max_ongoing_requests: {{ int .d.maxOngoingRequests }}
  autoscaling_config:
    min_replicas: {{ int .d.minReplicas }}
    max_replicas: {{ int .d.maxReplicas }}
    target_ongoing_requests: {{ .d.targetOngoingRequests }}
    policy:
      policy_function: {{ .policy }}
  ray_actor_options:
    num_cpus: {{ .d.numCpus }}
    num_gpus: {{ .gpus }}
    {{- with .resources }}
    resources: {{ toJson . }}
    {{- end }}
{{- end }}

{{/*
serveConfigV2: a Ray Serve config file in exactly the format services/config/ load_serve_config
parses (the chart tests load it with that function). The public API is the Router's own gRPC server
(args.api, args.security), not Serve's gRPC proxy, which the config leaves off.
*/}}
{{- define "treeserve.serveConfig" -}}
{{- $v := .Values }}
{{- $shares := include "treeserve.rankShares" . | fromJsonArray }}
{{- $cuda := eq $v.target.device "cuda" }}
{{- $tp := int $v.target.tensorParallelSize }}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ int $v.serve.httpPort }}
logging_config:
  enable_access_log: {{ $v.serve.enableAccessLog }}
  log_level: {{ $v.serve.logLevel }}
applications:
  - name: treeserve
    route_prefix: /
    import_path: treeserve.services.app:build_app
    runtime_env:
      env_vars:
        {{- if $cuda }}
        TORCH_NCCL_ASYNC_ERROR_HANDLING: "1"
        {{- end }}
        {{- range $k, $val := $v.serve.env }}
        {{ $k }}: {{ $val | toString | toJson }}
        {{- end }}
    args:
      target:
        {{- include "treeserve.modelArgs" (dict "m" $v.target "target" true) | nindent 8 }}
      drafter:
        {{- if include "treeserve.hasDrafter" . }}
        {{- include "treeserve.modelArgs" (dict "m" $v.drafter "target" false) | nindent 8 }}
        {{- else }}
        path: none
        {{- end }}
      speculation:
        method: {{ $v.speculation.method }}
        budget: {{ if eq (toString $v.speculation.budget) "auto" }}auto{{ else }}{{ int $v.speculation.budget }}{{ end }}
        batch_method: {{ $v.speculation.batchMethod }}
        run_ahead: {{ $v.speculation.runAhead }}
        catch_up_beside_tokens: {{ if kindIs "invalid" $v.speculation.catchUpBesideTokens }}null{{ else }}{{ int $v.speculation.catchUpBesideTokens }}{{ end }}
        lookup:
          shared_tokens: {{ int $v.speculation.lookupSharedTokens }}
      limits:
        max_prompt_tokens: {{ int $v.limits.maxPromptTokens }}
        max_new_tokens: {{ int $v.limits.maxNewTokens }}
        max_concurrent_requests: {{ int $v.limits.maxConcurrentRequests }}
        max_batch_size: {{ int $v.limits.maxBatchSize }}
        request_timeout_s: {{ $v.limits.requestTimeoutS }}
      grpc:
        max_message_bytes: {{ int64 $v.internalGrpc.maxMessageBytes }}
      api:
        host: 0.0.0.0
        port: {{ int $v.api.port }}
        max_request_bytes: {{ int64 $v.api.maxRequestBytes }}
        enable_reflection: {{ $v.api.enableReflection }}
        generation_config: {{ $v.api.generationConfig }}
        {{- if $v.api.httpPort }}
        http_port: {{ int $v.api.httpPort }}
        {{- end }}
      security:
        {{- if $v.security.tls.enabled }}
        tls_cert_file: {{ printf "%s/%s" (include "treeserve.tlsDir" .) $v.security.tls.certFile }}
        tls_key_file: {{ printf "%s/%s" (include "treeserve.tlsDir" .) $v.security.tls.keyFile }}
        {{- with $v.security.tls.clientCaFile }}
        tls_client_ca_file: {{ printf "%s/%s" (include "treeserve.tlsDir" $) . }}
        {{- end }}
        {{- end }}
        {{- if $v.security.auth.enabled }}
        auth_token_file: {{ printf "%s/%s" (include "treeserve.authDir" .) $v.security.auth.tokenFile }}
        {{- end }}
        allow_insecure: {{ and (not $v.security.tls.enabled) $v.security.allowInsecure }}
    deployments:
      {{- include "treeserve.deployment" (dict "name" "Router" "d" $v.serve.router "gpus" 0 "policy" "treeserve.services.app:router_autoscaling_policy" "resources" (dict "TreeServeRouter" 1)) | nindent 6 }}
      {{- if include "treeserve.hasDrafter" . }}
      {{- include "treeserve.deployment" (dict "name" "Drafter" "d" $v.serve.drafter "gpus" (ternary $v.serve.drafter.numGpus 0 (eq $v.drafter.device "cuda")) "policy" "treeserve.services.app:session_autoscaling_policy" "resources" (dict "TreeServeDrafter" 1)) | nindent 6 }}
      {{- end }}
      {{- if gt $tp 1 }}
      {{- include "treeserve.deployment" (dict "name" "Target" "d" $v.serve.target "gpus" 0 "policy" "treeserve.services.app:session_autoscaling_policy") | nindent 6 }}
        # A coordinator bundle (the pod's target slot) plus one bundle per TP rank, packed on one node (NCCL
        # over NVLink); on cuda each rank bundle holds its GPU share.
        placement_group_strategy: STRICT_PACK
        placement_group_bundles:
          - {CPU: {{ $v.serve.target.numCpus }}, TreeServeTarget: 1}
          {{- range $share := $shares }}
          - {CPU: {{ $v.serve.target.cpusPerRank }}{{ if $cuda }}, GPU: {{ $share }}{{ end }}}
          {{- end }}
      {{- else }}
      {{- include "treeserve.deployment" (dict "name" "Target" "d" $v.serve.target "gpus" (ternary (index $shares 0) 0 $cuda) "policy" "treeserve.services.app:session_autoscaling_policy" "resources" (dict "TreeServeTarget" 1)) | nindent 6 }}
      {{- end }}
{{- end }}

{{/* Volumes and mounts: the model directory (never a download), the API's secrets, the writable paths of a read-only root. */}}
{{- define "treeserve.volumes" -}}
{{- $v := .root.Values }}
{{- if eq $v.modelVolume.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $v.modelVolume.claimName }}
    readOnly: {{ $v.modelVolume.readOnly }}
{{- else if eq $v.modelVolume.type "hostPath" }}
- name: models
  hostPath:
    path: {{ $v.modelVolume.hostPath }}
    type: Directory
{{- end }}
- name: ray-logs
  emptyDir: {}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
- name: profiles
  emptyDir: {}
{{- if .api }}
{{- if $v.security.tls.enabled }}
- name: api-tls
  secret:
    secretName: {{ include "treeserve.tlsSecret" .root }}
    defaultMode: 0440
{{- end }}
{{- if $v.security.auth.enabled }}
- name: api-auth
  secret:
    secretName: {{ include "treeserve.authSecret" .root }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "treeserve.volumeMounts" -}}
{{- $v := .root.Values }}
{{- if ne $v.modelVolume.type "none" }}
- name: models
  mountPath: {{ $v.modelVolume.mountPath }}
  readOnly: {{ $v.modelVolume.readOnly }}
{{- end }}
- name: ray-logs
  mountPath: /tmp/ray
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/ray
- name: profiles
  mountPath: /opt/treeserve/cache/profiles
{{- if .api }}
{{- if $v.security.tls.enabled }}
- name: api-tls
  mountPath: {{ include "treeserve.tlsDir" .root }}
  readOnly: true
{{- end }}
{{- if $v.security.auth.enabled }}
- name: api-auth
  mountPath: {{ include "treeserve.authDir" .root }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* Pod metadata shared by head and workers. */}}
{{- define "treeserve.podMetadata" -}}
labels:
  {{- include "treeserve.rayPodSelectorLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- if or .Values.metrics.prometheusAnnotations .Values.podAnnotations }}
annotations:
  {{- if .Values.metrics.prometheusAnnotations }}
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .Values.ray.metricsPort | int | quote }}
  prometheus.io/path: /metrics
  {{- end }}
  {{- with .Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Pod-level scheduling and security shared by head and workers (.w: the group's values). */}}
{{- define "treeserve.podSpecCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .w.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container environment: the chart's, then every container's extraEnv, then the group's env. */}}
{{- define "treeserve.env" -}}
{{- $v := .root.Values }}
- {name: TREESERVE_CACHE, value: /opt/treeserve/cache}
{{- if .head }}
{{- with $v.dashboard.grafanaHost }}
- {name: RAY_GRAFANA_HOST, value: {{ . | quote }}}
- {name: RAY_GRAFANA_IFRAME_HOST, value: {{ $v.dashboard.grafanaIframeHost | default . | quote }}}
{{- end }}
{{- with $v.dashboard.prometheusHost }}
- {name: RAY_PROMETHEUS_HOST, value: {{ . | quote }}}
- {name: RAY_PROMETHEUS_NAME, value: {{ $v.dashboard.prometheusName | quote }}}
{{- end }}
{{- end }}
{{- range $e := concat ($v.extraEnv | default list) (.w.env | default list) }}
{{- if hasKey $e "value" }}
- name: {{ $e.name }}
  value: {{ $e.value | toString | quote }}  {{- /* `--set env[0].value=1` gives a number; EnvVar wants a string */}}
{{- else }}
- {{ toYaml $e | nindent 2 | trim }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Probes. httpGet/tcpSocket need no binary in the image: the raylet's agent answers liveness on 52365; a
router pod is ready when a Router's API server accepts connections on api.port (the API Service routes
only there), any other worker when its Serve proxy answers /-/healthz.
*/}}
{{- define "treeserve.probeTiming" -}}
initialDelaySeconds: {{ int .initialDelaySeconds }}
periodSeconds: {{ int .periodSeconds }}
timeoutSeconds: {{ int .timeoutSeconds }}
failureThreshold: {{ int .failureThreshold }}
{{- end }}

{{- define "treeserve.livenessProbe" -}}
livenessProbe:
  httpGet: {path: /api/local_raylet_healthz, port: 52365}
  {{- include "treeserve.probeTiming" .Values.probes.liveness | nindent 2 }}
{{- end }}
