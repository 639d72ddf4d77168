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
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
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
      num_replicas: {{ .Values.serve.numReplicas }}
      ingress_replicas: {{ .Values.serve.ingressReplicas }}
      max_pending: {{ .Values.serve.maxPending }}
      max_n: {{ .Values.serve.maxN }}
      max_body: {{ .Values.serve.maxBody | quote }}
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
