{{- define "vattn.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vattn.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vattn.labels" -}}
{{ include "vattn.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vattn.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* A Ray pod's metadata annotations: the checkov checks its pods pass by other means, or not by design, and why. */}}
{{- define "vattn.rayPodAnnotations" -}}
checkov.io/skip1: CKV_K8S_43=image.tag names a release; set image.digest to pin the image by digest
checkov.io/skip2: CKV_K8S_15=IfNotPresent - Ray GPU images are several GB and a tag names one release
checkov.io/skip3: CKV_K8S_22=Ray writes its session files, logs and JIT caches (Triton, HAProxy) under /tmp and the home directory
checkov.io/skip4: CKV_K8S_40=the Ray image's user is uid 1000, the owner of its home directory and Python
checkov.io/skip5: CKV2_K8S_6=networkPolicy.enabled - off by default, it needs an enforcing CNI and the cluster's own sources
{{- end -}}

{{/* Pod-level hardening of every Ray pod: security context, no API token. */}}
{{- define "vattn.podSecurity" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.security.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* A Ray container's security context and probes (KubeRay's own health checks, written out): the head checks its
raylet (liveness) and the GCS (readiness), a worker its raylet. Argument: (list $ "head"|"worker"). */}}
{{- define "vattn.rayContainerHardening" -}}
{{- $ := index . 0 -}}
{{- $probes := $.Values.probes -}}
securityContext:
  {{- toYaml $.Values.security.containerSecurityContext | nindent 2 }}
livenessProbe:
  httpGet: {path: /api/local_raylet_healthz, port: {{ $probes.dashboardAgentPort }}}
  initialDelaySeconds: 30
  periodSeconds: {{ $probes.periodSeconds }}
  timeoutSeconds: {{ $probes.timeoutSeconds }}
  failureThreshold: {{ $probes.livenessFailureThreshold }}
readinessProbe:
  {{- if eq (index . 1) "head" }}
  httpGet: {path: /api/gcs_healthz, port: {{ $probes.dashboardPort }}}
  {{- else }}
  httpGet: {path: /api/local_raylet_healthz, port: {{ $probes.dashboardAgentPort }}}
  {{- end }}
  initialDelaySeconds: 10
  periodSeconds: {{ $probes.periodSeconds }}
  timeoutSeconds: {{ $probes.timeoutSeconds }}
  failureThreshold: {{ $probes.readinessFailureThreshold }}
{{- end -}}

{{/* GPUs one engine replica's pod asks for: its tensor x pipeline parallel workers. */}}
{{- define "vattn.gpusPerReplica" -}}
{{ mul .Values.engine.tensorParallelSize .Values.engine.pipelineParallelSize }}
{{- end -}}

{{/* The Serve config KubeRay submits: vattn serve's options (server/args.py) from the values. */}}
{{- define "vattn.serveConfig" -}}
proxy_location: HeadOnly
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
applications:
  - name: vattn
    route_prefix: /
    import_path: server.app:app_builder
    args:
      model: {{ .Values.model.path | quote }}
      served_model_name: {{ .Values.model.servedName | quote }}
      device: {{ .Values.engine.device }}
      tensor_parallel_size: {{ .Values.engine.tensorParallelSize }}
      pipeline_parallel_size: {{ .Values.engine.pipelineParallelSize }}
      kv_layout: {{ .Values.engine.kvLayout }}
      page_size: {{ .Values.engine.pageSize | quote }}
      {{- if .Values.engine.kvMemory }}
      kv_memory: {{ .Values.engine.kvMemory | quote }}
      {{- else if .Values.engine.gpuMemoryUtilization }}
      gpu_memory_utilization: {{ .Values.engine.gpuMemoryUtilization }}
      {{- else }}
      kv_memory_fraction: {{ .Values.engine.kvMemoryFraction }}
      {{- end }}
      max_num_seqs: {{ .Values.engine.maxNumSeqs }}
      max_num_batched_tokens: {{ .Values.engine.maxNumBatchedTokens }}
      {{- with .Values.engine.maxModelLen }}
      max_model_len: {{ . }}
      {{- end }}
      placement_strategy: {{ .Values.engine.placementStrategy }}
      enable_prefix_caching: {{ .Values.engine.enablePrefixCaching }}
      deterministic: {{ .Values.engine.deterministic }}
      eager_slots: {{ .Values.engine.eagerSlots }}
      {{- if not (kindIs "invalid" .Values.engine.mixedGraphTokens) }}
      mixed_graph_tokens: {{ .Values.engine.mixedGraphTokens }}
      {{- end }}
      num_replicas: {{ .Values.serve.numReplicas }}
      ingress_replicas: {{ .Values.serve.ingressReplicas }}
      max_pending: {{ .Values.serve.maxPending }}
      max_n: {{ .Values.serve.maxN }}
      max_body: {{ .Values.serve.maxBody | quote }}
      drain_timeout_s: {{ .Values.serve.drainTimeoutS }}
{{- end -}}

{{/* Environment of every Ray container: NCCL settings, the API key (the replicas read $VATTN_API_KEY), extras. */}}
{{- define "vattn.env" -}}
{{- range $name, $value := .Values.ncclEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- range $name, $value := .Values.serveEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- range $name, $value := .Values.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- if .Values.apiKey.secretName }}
- name: VATTN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- end -}}

{{- define "vattn.modelVolume" -}}
{{- if eq .Values.model.volume.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.claimName }}
    readOnly: {{ .Values.model.volume.readOnly }}
{{- else if eq .Values.model.volume.type "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.volume.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "vattn.modelMount" -}}
{{- if ne .Values.model.volume.type "none" }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: {{ .Values.model.volume.readOnly }}
{{- end }}
{{- end -}}
