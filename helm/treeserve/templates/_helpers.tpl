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
Fail fast on layouts that cannot start: the schema checks types and ranges, these check relations
between values (a TP size that does not divide the heads would only fail once the weights are loaded).
*/}}
{{- define "treeserve.checks" -}}
{{- $t := .Values.target }}
{{- $tp := int $t.tensorParallelSize }}
{{- range $key := list "numAttentionHeads" "numKeyValueHeads" }}
{{- $heads := index $t $key }}
{{- if and $heads (mod (int $heads) $tp) }}
{{- fail (printf "target.tensorParallelSize=%d must divide target.%s=%d" $tp $key (int $heads)) }}
{{- end }}
{{- end }}
{{- range $role := list "target" "drafter" }}
{{- $m := index $.Values $role }}
{{- /* models shipped in the image: the target "default", its drafters "default" and "eagle" */}}
{{- $embedded := ternary (list "default" "eagle") (list "default") (eq $role "drafter") }}
{{- if and (not (has $m.path $embedded)) (not (hasPrefix (printf "%s/" (trimSuffix "/" $.Values.modelVolume.mountPath)) $m.path)) }}
{{- fail (printf "%s.path=%s must be one of %s or a directory under modelVolume.mountPath=%s" $role $m.path (join ", " $embedded) $.Values.modelVolume.mountPath) }}
{{- end }}
{{- if and (not (has $m.path $embedded)) (eq $.Values.modelVolume.type "none") }}
{{- fail (printf "%s.path=%s needs a model volume: set modelVolume.type to pvc or hostPath" $role $m.path) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.drafter.device "cuda") (lt (float64 .Values.serve.drafter.numGpus) 1.0) }}
{{- fail "drafter.device=cuda needs serve.drafter.numGpus >= 1" }}
{{- end }}
{{- if and (eq .Values.drafter.device "cuda") (lt (int .Values.ray.drafterWorkers.gpus) 1) }}
{{- fail "drafter.device=cuda needs ray.drafterWorkers.gpus >= 1" }}
{{- end }}
{{- if and (eq .Values.modelVolume.type "pvc") (not .Values.modelVolume.claimName) }}
{{- fail "modelVolume.type=pvc needs modelVolume.claimName" }}
{{- end }}
{{- if and (eq .Values.modelVolume.type "hostPath") (not .Values.modelVolume.hostPath) }}
{{- fail "modelVolume.type=hostPath needs modelVolume.hostPath" }}
{{- end }}
{{- if and .Values.ingress.enabled .Values.ingress.tls.enabled (not .Values.ingress.tls.secretName) }}
{{- fail "ingress.tls.enabled needs ingress.tls.secretName" }}
{{- end }}
{{- end }}

{{/* GPUs per target worker pod: one per TP rank on cuda. */}}
{{- define "treeserve.targetGpus" -}}
{{- if eq .Values.target.device "cuda" }}{{ int .Values.target.tensorParallelSize }}{{ else }}0{{ end }}
{{- end }}

{{/* A model section of the app args (services/config.py ModelConfig / DrafterConfig). */}}
{{- define "treeserve.modelArgs" -}}
path: {{ .m.path | toJson }}
dtype: {{ .m.dtype }}
device: {{ .m.device }}
max_context_tokens: {{ int .m.maxContextTokens }}
{{- if .target }}
tensor_parallel_size: {{ int .m.tensorParallelSize }}
{{- with .m.numAttentionHeads }}
num_attention_heads: {{ int . }}
{{- end }}
{{- with .m.numKeyValueHeads }}
num_key_value_heads: {{ int . }}
{{- end }}
{{- else }}
kind: {{ .m.kind }}
{{- end }}
{{- end }}

{{/* One Serve deployment override (services/config.py DeploymentConfig). */}}
{{- define "treeserve.deployment" -}}
- name: {{ .name }}
  max_ongoing_requests: {{ int .d.maxOngoingRequests }}
  autoscaling_config:
    min_replicas: {{ int .d.minReplicas }}
    max_replicas: {{ int .d.maxReplicas }}
    target_ongoing_requests: {{ .d.targetOngoingRequests }}
    {{- if .sessionPolicy }}
    policy:
      policy_function: treeserve.services.app:session_autoscaling_policy
    {{- end }}
  ray_actor_options:
    num_cpus: {{ .d.numCpus }}
    num_gpus: {{ .gpus }}
{{- end }}

{{/*
serveConfigV2: a Ray Serve config file in exactly the format services/config.py load_serve_config
parses (the chart tests load it with that function).
*/}}
{{- define "treeserve.serveConfig" -}}
{{- $v := .Values }}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ int $v.serve.httpPort }}
grpc_options:
  port: {{ int $v.serve.grpcPort }}
  grpc_servicer_functions:
    - treeserve.v1.generation_pb2_grpc.add_TreeServeServicer_to_server
logging_config:
  enable_access_log: {{ $v.serve.enableAccessLog }}
  log_level: {{ $v.serve.logLevel }}
applications:
  - name: treeserve
    route_prefix: /
    import_path: treeserve.services.app:build_app
    runtime_env:
      env_vars:
        {{- if eq $v.target.device "cuda" }}
        TORCH_NCCL_ASYNC_ERROR_HANDLING: "1"
        {{- end }}
        {{- range $k, $val := $v.serve.env }}
        {{ $k }}: {{ $val | toString | toJson }}
        {{- end }}
    args:
      target:
        {{- include "treeserve.modelArgs" (dict "m" $v.target "target" true) | nindent 8 }}
      drafter:
        {{- include "treeserve.modelArgs" (dict "m" $v.drafter "target" false) | nindent 8 }}
      speculation:
        method: {{ $v.speculation.method }}
        budget: {{ if eq (toString $v.speculation.budget) "auto" }}auto{{ else }}{{ int $v.speculation.budget }}{{ end }}
        batch_method: {{ $v.speculation.batchMethod }}
      limits:
        max_prompt_tokens: {{ int $v.limits.maxPromptTokens }}
        max_new_tokens: {{ int $v.limits.maxNewTokens }}
        max_concurrent_requests: {{ int $v.limits.maxConcurrentRequests }}
        max_batch_size: {{ int $v.limits.maxBatchSize }}
        request_timeout_s: {{ $v.limits.requestTimeoutS }}
      grpc:
        max_message_bytes: {{ int64 $v.internalGrpc.maxMessageBytes }}
    deployments:
      {{- include "treeserve.deployment" (dict "name" "Router" "d" $v.serve.router "gpus" 0) | nindent 6 }}
      {{- include "treeserve.deployment" (dict "name" "Drafter" "d" $v.serve.drafter "gpus" $v.serve.drafter.numGpus "sessionPolicy" true) | nindent 6 }}
      {{- include "treeserve.deployment" (dict "name" "Target" "d" $v.serve.target "gpus" 0 "sessionPolicy" true) | nindent 6 }}
      {{- if eq $v.target.device "cuda" }}
        # A coordinator bundle plus one GPU bundle per TP rank, packed on one node (NCCL over NVLink).
        placement_group_strategy: STRICT_PACK
        placement_group_bundles:
          - {CPU: {{ $v.serve.target.numCpus }}}
          {{- range until (int $v.target.tensorParallelSize) }}
          - {CPU: {{ $v.serve.target.cpusPerRank }}, GPU: 1}
          {{- end }}
      {{- end }}
{{- end }}

{{/* Volumes and mounts for the model directory (never a download). */}}
{{- define "treeserve.volumes" -}}
{{- if eq .Values.modelVolume.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.claimName }}
    readOnly: {{ .Values.modelVolume.readOnly }}
{{- else if eq .Values.modelVolume.type "hostPath" }}
- name: models
  hostPath:
    path: {{ .Values.modelVolume.hostPath }}
    type: Directory
{{- end }}
- name: ray-logs
  emptyDir: {}
{{- end }}

{{- define "treeserve.volumeMounts" -}}
{{- if ne .Values.modelVolume.type "none" }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: {{ .Values.modelVolume.readOnly }}
{{- end }}
- name: ray-logs
  mountPath: /tmp/ray
{{- end }}

{{/* Pod metadata shared by head and workers. */}}
{{- define "treeserve.podMetadata" -}}
labels:
  {{- include "treeserve.selectorLabels" . | nindent 2 }}
{{- if .Values.metrics.prometheusAnnotations }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .Values.ray.metricsPort | int | quote }}
  prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Container ports shared by head and workers. */}}
{{- define "treeserve.ports" -}}
- {name: serve, containerPort: {{ int .Values.serve.httpPort }}}
- {name: grpc, containerPort: {{ int .Values.serve.grpcPort }}}
- {name: metrics, containerPort: {{ int .Values.ray.metricsPort }}}
{{- end }}

{{/*
Probes. httpGet needs no binary in the image: the raylet's agent answers liveness on 52365, the
Serve proxy's /-/healthz answers readiness (a worker without replicas stays unready, as in KubeRay's
own defaults, and so receives no gRPC traffic).
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
