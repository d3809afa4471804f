{{/* Chart name, cut to 63 characters (the DNS label limit). */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart name. */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end }}

{{/* Selector labels: stable across upgrades, so no version here. */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specserve.configMapName" -}}
{{- printf "%s-config" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret of the API key files: the operator's (apiKeys.existingSecret) or the chart's. */}}
{{- define "specserve.apiKeysSecretName" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else }}
{{- printf "%s-api-keys" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The revision of the router config file the ConfigMap holds (toYaml's text plus the newline
the block scalar keeps): the first 12 hex digits of its SHA-256, as the routers compute it. */}}
{{- define "specserve.configRevision" -}}
{{- printf "%s\n" (toYaml .Values.config) | sha256sum | trunc 12 }}
{{- end }}

{{/* Refuse what the schema cannot express, with the key that is wrong. */}}
{{- define "specserve.validate" -}}
{{- $names := list }}
{{- $positive := false }}
{{- range .Values.config.arms }}
{{- if has .name $names }}
{{- fail (printf "config.arms: duplicate arm name %q" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- if gt (float64 .weight) 0.0 }}{{ $positive = true }}{{ end }}
{{- end }}
{{- if not $positive }}
{{- fail "config.arms: at least one arm needs weight > 0" }}
{{- end }}
{{- with .Values.apiKeys }}
{{- if and (not .enabled) (not .allowUnauthenticated) }}
{{- fail "apiKeys.enabled: false serves every route, the engines included, to anyone who reaches port 8000; set apiKeys.allowUnauthenticated: true as well to mean it" }}
{{- end }}
{{- end }}
{{- if .Values.networkPolicy.enabled }}
{{- range .Values.networkPolicy.apiFrom }}
{{- if has . $.Values.networkPolicy.operatorFrom }}
{{- fail (printf "networkPolicy.apiFrom: peer %s is in operatorFrom too, which reaches Ray's dashboard and job API (port 8265): give API clients a peer of their own" (toJson .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The image of every Ray pod: the GPU or CPU build, as the model's accelerator says. */}}
{{- define "specserve.image" -}}
{{- $flavour := ternary "gpu" "cpu" (eq (default "gpu" .Values.config.model.accelerator) "gpu") }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $flavour) .Values.image.tag) }}
{{- end }}

{{/* The Serve config (router app + one app per arm): `specserve config serve-config` renders the
same document from the same router config; a test keeps the two equal. */}}
{{- define "specserve.serveConfig" -}}
{{- $routerArgs := dict "config_path" "/etc/specserve/config.yaml" "config_poll_s" .Values.router.configPollSeconds "replicas" .Values.router.replicas }}
{{- /* The key files of the mounted Secret (serve_config.py's MOUNTED_KEYS_DIR): the dispatch in
every HTTP proxy reads them and re-reads them when kubelet updates the mount. */}}
{{- if .Values.apiKeys.enabled }}
{{- $_ := set $routerArgs "api_keys_file" "/etc/specserve/keys/api-keys" }}
{{- $_ := set $routerArgs "admin_keys_file" "/etc/specserve/keys/admin-keys" }}
{{- end }}
{{- $router := dict "name" "specserve" "route_prefix" "/" "import_path" "specserve.router.ingress:build_app" "args" $routerArgs }}
{{- $apps := list $router }}
{{- range .Values.config.arms }}
{{- $args := dict "model" $.Values.config.model "arm" (omit . "weight" "replicas" "max_ongoing_requests" "max_queued_requests" "max_surge_percent") }}
{{- $app := dict "name" (printf "arm-%s" .name) "route_prefix" (printf "/arms/%s" .name) "import_path" "specserve.engine.arm:build_app" "args" $args }}
{{- /* Replica and queue settings as deployment options, named as Ray Serve names them (config.py's
DEPLOYMENT_OPTIONS): Ray Serve applies them in place. */}}
{{- $arm := . }}
{{- $options := dict }}
{{- range $key, $option := dict "replicas" "num_replicas" "max_ongoing_requests" "max_ongoing_requests" "max_queued_requests" "max_queued_requests" "max_surge_percent" "max_surge_percent" }}
{{- if hasKey $arm $key }}{{- $_ := set $options $option (get $arm $key) }}{{- end }}
{{- end }}
{{- if $options }}{{- $_ := set $app "deployments" (list (merge (dict "name" (printf "arm-%s" .name)) $options)) }}{{- end }}
{{- $apps = append $apps $app }}
{{- end }}
{{- toYaml (dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" $apps) }}
{{- end }}

{{/* Volumes and mounts every Ray container needs under the restricted Pod Security profile (a
read-only root file system): Ray's session files under /tmp, caches under $HOME, shared memory,
the router config from its ConfigMap and the API key files from their Secret (every node's HTTP
proxy checks keys). Both are whole-volume mounts, never subPath: kubelet updates them in place,
so a new config or a rotated key applies without a restart. The keys' mount point lies inside the
config's volume: kubelet creates it there (nested ConfigMap and Secret mounts, Kubernetes 1.10+). */}}
{{- define "specserve.volumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .group.shmSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: router-config
  configMap:
    name: {{ include "specserve.configMapName" .root }}
{{- if .root.Values.apiKeys.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "specserve.apiKeysSecretName" .root }}
{{- end }}
{{- with .root.Values.modelCache }}
{{- if .enabled }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "specserve.fullname" $.root)) .existingClaim }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/ray
- name: dshm
  mountPath: /dev/shm
- name: router-config
  mountPath: /etc/specserve
  readOnly: true
{{- if .Values.apiKeys.enabled }}
- name: api-keys
  mountPath: /etc/specserve/keys
  readOnly: true
{{- end }}
{{- if .Values.modelCache.enabled }}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- end }}
{{- end }}

{{- define "specserve.env" -}}
- name: SPECSERVE_CONFIG
  value: /etc/specserve/config.yaml
# The HTTP proxy of every Ray node loads specserve's dispatch, which routes inference requests
# straight to the chosen arm's replicas.
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: specserve.router.dispatch:middlewares
{{- if .Values.modelCache.enabled }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelCache.mountPath }}
{{- end }}
{{- with .Values.huggingFaceToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.huggingFaceToken.secretKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* One Ray pod (head or worker group): restricted Pod Security profile, the router config
mounted, writable emptyDirs where Ray and vLLM write. Args: root, group, image, container. */}}
{{- define "specserve.podSpec" -}}
{{- $root := .root }}
{{- $group := .group }}
serviceAccountName: {{ include "specserve.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .container }}
    image: {{ .image }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    ports:
      {{- if eq .container "ray-head" }}
      - name: gcs-server
        containerPort: 6379
      - name: dashboard
        containerPort: 8265
      - name: client
        containerPort: 10001
      {{- end }}
      - name: serve
        containerPort: 8000
      # Ray's metrics export port: the router's, vLLM's and Ray Serve's metrics of this node.
      - name: metrics
        containerPort: 8080
    env:
      {{- include "specserve.env" $root | nindent 6 }}
    resources:
      {{- toYaml $group.resources | nindent 6 }}
    {{- with $group.startupProbe }}
    startupProbe:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- include "specserve.volumeMounts" $root | nindent 6 }}
volumes:
  {{- include "specserve.volumes" (dict "root" $root "group" $group) | nindent 2 }}
{{- end }}
