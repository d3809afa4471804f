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

{{/* The keys the chart drew, in plain text for the operator; mounted nowhere. */}}
{{- define "specserve.issuedKeysSecretName" -}}
{{- printf "%s-api-keys-issued" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Where the operator reads a key to hand out: their own Secret, else the chart's issued one. */}}
{{- define "specserve.handOutKeysSecretName" -}}
{{- default (include "specserve.issuedKeysSecretName" .) .Values.apiKeys.existingSecret }}
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

{{/* The router config file of the values (toYaml's text and a final newline). */}}
{{- define "specserve.valuesConfigText" -}}
{{- printf "%s\n" (toYaml .Values.config) }}
{{- end }}

{{/* The revision of a config file's text: the first 12 hex digits of its SHA-256, as the routers
compute it. */}}
{{- define "specserve.valuesConfigRevision" -}}
{{- include "specserve.valuesConfigText" . | sha256sum | trunc 12 }}
{{- end }}

{{/* The router config file the chart renders. The values' `config`, unless the live ConfigMap was
last rendered from these same values (its `specserve.io/values-revision`) and holds another
config since: one that `specserve config apply`, a rollback or the loop wrote. That one is
rendered back byte for byte, so an upgrade that leaves the values' config as it was neither
reverts it nor conflicts with the field `config apply` owns; an upgrade that changes the values'
config is the operator's to force (`--force-conflicts`, docs/kubernetes.md). Offline (no
cluster to look up) and at install: the values'. */}}
{{- define "specserve.configText" -}}
{{- $live := lookup "v1" "ConfigMap" .Release.Namespace (include "specserve.configMapName" .) | default dict }}
{{- $text := include "specserve.valuesConfigText" . }}
{{- if eq (dig "metadata" "annotations" "specserve.io/values-revision" "" $live) (include "specserve.valuesConfigRevision" .) }}
{{- $text = dig "data" "config.yaml" $text $live }}
{{- end }}
{{- $text }}
{{- end }}

{{/* The revision of the config the chart renders (specserve.configText). */}}
{{- define "specserve.configRevision" -}}
{{- include "specserve.configText" . | sha256sum | trunc 12 }}
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
{{- /* With trust_remote_code an arm's engines run the code in the target's and its drafter's hub
repositories: each is pinned to a commit (config/schema.py's unpinned_code). */}}
{{- $hubId := include "specserve.hubIdPattern" . }}
{{- $model := .Values.config.model }}
{{- range $i, $arm := .Values.config.arms }}
{{- if dig "engine" "trust_remote_code" false $arm }}
{{- if and (regexMatch $hubId $model.source) (not $model.revision) }}
{{- fail (printf "config.model.revision: arm %q sets trust_remote_code, so its engines run the code in the hub repository %s; pin the commit you reviewed (40 hex digits: --set config.model.revision=COMMIT; docs/security.md)" $arm.name $model.source) }}
{{- end }}
{{- $drafter := dig "speculative" "model" "" $arm }}
{{- if and $drafter (regexMatch $hubId $drafter) (not (dig "speculative" "revision" "" $arm)) }}
{{- fail (printf "config.arms[%d].speculative.revision: arm %q sets trust_remote_code, so its engines also run the code in its drafter's hub repository %s; pin the commit you reviewed (40 hex digits: --set config.arms[%d].speculative.revision=COMMIT; docs/security.md)" $i $arm.name $drafter $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.apiKeys }}
{{- if and (not .enabled) (not .allowUnauthenticated) }}
{{- fail "apiKeys.enabled: false serves every route, the engines included, to anyone who reaches port 8000; set apiKeys.allowUnauthenticated: true as well to mean it" }}
{{- end }}
{{- end }}
{{- if and (eq .Values.ray.auth "disabled") (not .Values.networkPolicy.enabled) (not .Values.ray.allowUnauthenticated) }}
{{- fail "ray.auth: disabled with networkPolicy.enabled: false lets anyone who reaches a pod's Ray ports run code in it; set ray.allowUnauthenticated: true as well to mean it" }}
{{- end }}
{{- /* KubeRay appends 6 characters to a RayService's name for its RayCluster and refuses a
RayService name over 47 characters, or one that is no DNS-1035 label. */}}
{{- $fullname := include "specserve.fullname" . }}
{{- if gt (len $fullname) 47 }}
{{- fail (printf "release name: the RayService would be named %q, %d characters; KubeRay accepts at most 47 (it appends 6 for its RayCluster): choose a shorter release name or set fullnameOverride" $fullname (len $fullname)) }}
{{- end }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $fullname) }}
{{- fail (printf "release name: the RayService would be named %q; KubeRay wants a DNS-1035 label (a lower-case letter first, then letters, digits and '-'): choose another release name or set fullnameOverride" $fullname) }}
{{- end }}
{{- /* The operator's version cannot be read from the cluster (.Capabilities knows API groups,
not operator versions): the values say it, and the chart's annotation says the oldest it works with. */}}
{{- $minimum := index .Chart.Annotations "specserve.io/kuberay-min-version" }}
{{- if not (semverCompare (printf ">=%s-0" $minimum) .Values.kuberay.version) }}
{{- fail (printf "kuberay.version: %s is older than KubeRay %s, the oldest this chart works with (authOptions, Ray's token auth, needs 1.5.1 and older operators drop it; the serve Service's own port needs 1.6): upgrade the KubeRay operator and set kuberay.version to its version" .Values.kuberay.version $minimum) }}
{{- end }}
{{- include "specserve.validateClaim" (dict "root" . "key" "modelCache") }}
{{- include "specserve.validateClaim" (dict "root" . "key" "captureStore") }}
{{- range $i, $group := prepend .Values.workerGroups .Values.head }}
{{- $key := ternary "head" (printf "workerGroups[%d]" (sub $i 1)) (eq $i 0) }}
{{- with $group.shmSizeLimit }}
{{- $store := get $group.rayStartParams "object-store-memory" }}
{{- if not $store }}
{{- fail (printf "%s.rayStartParams.object-store-memory: unset, Ray's object store takes 30%% of the pod's memory, more than /dev/shm (%s.shmSizeLimit %s) holds: set it in bytes below the limit" $key $key .) }}
{{- end }}
{{- if not (regexMatch "^[0-9]+$" $store) }}
{{- fail (printf "%s.rayStartParams.object-store-memory: %q is no number of bytes" $key $store) }}
{{- end }}
{{- if ge (int64 $store) (int64 (include "specserve.bytes" (dict "quantity" . "key" (printf "%s.shmSizeLimit" $key)))) }}
{{- fail (printf "%s.rayStartParams.object-store-memory: %s bytes do not fit in /dev/shm (%s.shmSizeLimit %s): set it below the limit" $key $store $key .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if gt (int (include "specserve.requestTimeoutSeconds" .)) (int .Values.drain.requestSeconds) }}
{{- fail (printf "config.limits.request_timeout_s: %s s, more than drain.requestSeconds (%d s), the longest request the pods' drain waits for: a stopping pod would cut such a request; raise drain.requestSeconds" (include "specserve.requestTimeoutSeconds" .) (int .Values.drain.requestSeconds)) }}
{{- end }}
{{- if gt (int .Values.drain.stopSeconds) (int .Values.drain.marginSeconds) }}
{{- fail "drain.stopSeconds: more than drain.marginSeconds, so the drain would end before the longest request may; raise drain.marginSeconds" }}
{{- end }}
{{- if .Values.networkPolicy.enabled }}
{{- range .Values.networkPolicy.apiFrom }}
{{- if has . $.Values.networkPolicy.operatorFrom }}
{{- fail (printf "networkPolicy.apiFrom: peer %s is in operatorFrom too, which reaches Ray's dashboard and job API (port 8265): give API clients a peer of their own" (toJson .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A claim every engine pod mounts (the head does no model work): the model cache, the capture
store. Args: root, key (the values section's name). */}}
{{- define "specserve.validateClaim" -}}
{{- $key := .key }}
{{- with index .root.Values $key }}
{{- if .enabled }}
{{- if and (has "ReadWriteMany" .accessModes) (not .existingClaim) (not .storageClassName) }}
{{- fail (printf "%s.storageClassName: a ReadWriteMany claim needs a storage class that provides ReadWriteMany (NFS, CephFS, Amazon EFS, Filestore, Azure Files, ...); the usual default classes are block storage and leave the claim Pending. Name such a class, or mount a claim of your own with %s.existingClaim (docs/kubernetes.md)" $key $key) }}
{{- end }}
{{- $pods := 0 }}
{{- range $.root.Values.workerGroups }}
{{- $pods = add $pods (default .replicas .maxReplicas) }}
{{- end }}
{{- if and (gt (int $pods) 1) (not (has "ReadWriteMany" .accessModes)) (not (has "ReadOnlyMany" .accessModes)) }}
{{- fail (printf "%s.accessModes: %s attaches the volume to one node, but %d engine pods mount it (the worker groups' maxReplicas), which gives Multi-Attach errors: use [ReadWriteMany] with a %s.storageClassName that provides it, or a single engine pod (with %s.existingClaim, give the claim's own access modes)" $key (join "," .accessModes) (int $pods) $key $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity (`2Gi`, `64G`, `1073741824`) in bytes. Args: quantity, key (named when
it cannot be read). */}}
{{- define "specserve.bytes" -}}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $quantity := toString .quantity }}
{{- $number := regexFind "^[0-9]+" $quantity }}
{{- $unit := trimPrefix $number $quantity }}
{{- if or (not $number) (not (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is no whole quantity the chart reads (e.g. 2Gi, 512Mi, 64G)" .key $quantity) }}
{{- end }}
{{- mul (int64 $number) (get $units $unit) }}
{{- end }}

{{/* The longest a request may run, in whole seconds: config.limits.request_timeout_s (600 when
unset, as in config.py). */}}
{{- define "specserve.requestTimeoutSeconds" -}}
{{- int (ceil (float64 (dig "limits" "request_timeout_s" 600 .Values.config))) }}
{{- end }}

{{/* The seconds kubelet gives a stopping Ray pod: the longest request it waits for
(drain.requestSeconds) plus drain.marginSeconds. */}}
{{- define "specserve.gracePeriodSeconds" -}}
{{- add (int .Values.drain.requestSeconds) .Values.drain.marginSeconds }}
{{- end }}

{{/* The image of every Ray pod: the GPU or CPU build, as the model's accelerator says. */}}
{{- define "specserve.image" -}}
{{- $flavour := ternary "gpu" "cpu" (eq (default "gpu" .Values.config.model.accelerator) "gpu") }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $flavour) .Values.image.tag) }}
{{- end }}

{{/* The Serve config (router app + one app per arm): `specserve config serve-config` renders the
same document from the same router config; a test keeps the two equal. */}}
{{- define "specserve.serveConfig" -}}
{{- $config := include "specserve.configText" . | fromYaml }}
{{- $routerArgs := dict "config_path" "/etc/specserve/config.yaml" "config_poll_s" .Values.router.configPollSeconds "replicas" .Values.router.replicas }}
{{- /* The key files of the mounted Secret (config/serve_config.py's MOUNTED_KEYS_DIR): the dispatch in
every HTTP proxy reads them and re-reads them when kubelet updates the mount. */}}
{{- if .Values.apiKeys.enabled }}
{{- $_ := set $routerArgs "api_keys_file" "/etc/specserve/keys/api-keys" }}
{{- $_ := set $routerArgs "admin_keys_file" "/etc/specserve/keys/admin-keys" }}
{{- $_ := set $routerArgs "sticky_salt_file" "/etc/specserve/keys/sticky-salt" }}
{{- end }}
{{- /* The router replica asks for no CPU (config/serve_config.py's ROUTER_NUM_CPUS): it only answers
/ready, /v1/models and /openapi.json, and the head, where it may land, offers no CPUs. */}}
{{- $routerDeployment := dict "name" "router" "ray_actor_options" (dict "num_cpus" 0) }}
{{- $router := dict "name" "specserve" "route_prefix" "/" "import_path" "specserve.router.ingress:build_app" "args" $routerArgs "deployments" (list $routerDeployment) }}
{{- $apps := list $router }}
{{- range $config.arms }}
{{- /* The arm's keys the router applies itself or that are deployment options are no engine
args (ArmEngineConfig refuses them): the list is generated from config/schema.py
(_generated.tpl). */}}
{{- $engineArm := deepCopy . }}
{{- range splitList " " (include "specserve.notEngineArgs" $) }}{{- $_ := unset $engineArm . }}{{- end }}
{{- $args := dict "model" $config.model "arm" $engineArm }}
{{- $app := dict "name" (printf "arm-%s" .name) "route_prefix" (printf "/arms/%s" .name) "import_path" "specserve.engine.arm:build_app" "args" $args }}
{{- /* Replica and queue settings as deployment options, named as Ray Serve names them
(config/schema.py's DEPLOYMENT_OPTIONS): Ray Serve applies them in place. */}}
{{- $arm := . }}
{{- $options := dict }}
{{- range $key, $option := dict "replicas" "num_replicas" "max_ongoing_requests" "max_ongoing_requests" "max_queued_requests" "max_queued_requests" "max_surge_percent" "max_surge_percent" }}
{{- if hasKey $arm $key }}{{- $_ := set $options $option (get $arm $key) }}{{- end }}
{{- end }}
{{- /* An EAGLE arm's drafter weights as its user_config, null included (ArmConfig.deployment_options):
its running engines load them in place. */}}
{{- if eq (dig "speculative" "method" "none" $arm) "eagle3" }}
{{- $_ := set $options "user_config" (dict "drafter_weights" (index $arm "drafter_weights")) }}
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
{{- if and .enabled $.engines }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "specserve.fullname" $.root)) .existingClaim }}
{{- end }}
{{- end }}
{{- with .root.Values.captureStore }}
{{- if and .enabled $.engines }}
- name: capture-store
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-capture" (include "specserve.fullname" $.root)) .existingClaim }}
{{- else if $.engines }}
{{- /* Without a store an arm's capture stays on the pod, bounded: past the limit the kubelet
evicts the pod rather than let captured traffic fill the node's disk. */}}
- name: capture-store
  emptyDir:
    sizeLimit: {{ .podSizeLimit }}
{{- end }}
{{- end }}
{{- end }}

{{/* Args: root, engines (a worker pod: engines run there and mount the model cache). */}}
{{- define "specserve.volumeMounts" -}}
{{- with .root }}
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
{{- end }}
{{- include "specserve.modelCacheMount" . }}
{{- if .engines }}
- name: capture-store
  mountPath: {{ .root.Values.captureStore.mountPath }}
{{- end }}
{{- end }}

{{- define "specserve.modelCacheMount" -}}
{{- if and .root.Values.modelCache.enabled .engines }}
- name: model-cache
  mountPath: {{ .root.Values.modelCache.mountPath }}
{{- end }}
{{- end }}

{{/* Hugging Face's cache directory, in a subdirectory of the model cache. */}}
{{- define "specserve.hfHome" -}}
{{- printf "%s/huggingface" .Values.modelCache.mountPath }}
{{- end }}

{{/* Args: root, engines. The model's settings (cache, hub token) only where engines run. */}}
{{- define "specserve.env" -}}
{{- $root := .root }}
{{- $engines := .engines }}
{{- with .root }}
- name: SPECSERVE_CONFIG
  value: /etc/specserve/config.yaml
# The HTTP proxy of every Ray node loads specserve's dispatch, which routes inference requests
# straight to the chosen arm's replicas.
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: specserve.router.dispatch:middlewares
# Ray starts its workers (engines, proxies, replicas) at nice 15, below its own daemons: here
# they are the pod's work.
- name: RAY_worker_niceness
  value: "0"
# A node whose last replica left (a drained pod) keeps its HTTP proxy while a request may still
# run through it: Ray Serve ends such a proxy once it has no requests of its own, and the
# dispatch's requests bypass that count (the pod's preStop waits for them instead).
- name: RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S
  value: {{ .Values.drain.requestSeconds | quote }}
# A Serve controller started again (a new head) recovers the replicas still running and kills
# any that has not answered within this many seconds (Ray's default: 30). Busy engines can
# take longer to answer, and a replica killed there is an engine to load again.
- name: RAY_SERVE_SLOW_STARTUP_WARNING_S
  value: "120"
# kubelet's SIGTERM follows the preStop drain (drain-node), so Ray's own drain on SIGTERM (30 s
# by default) has nothing left to do but wait: on the head, whose raylet never idles (the Serve
# controller), all 30 s, past the drain.stopSeconds Ray has to stop in.
- name: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
  value: "0"
{{- if and .Values.modelCache.enabled $engines }}
- name: HF_HOME
  value: {{ include "specserve.hfHome" . }}
{{- end }}
{{- if $engines }}
# The arms' engine replicas keep their capture samples here (docs/capture.md).
- name: SPECSERVE_CAPTURE_DIR
  value: {{ .Values.captureStore.mountPath }}
{{- end }}
{{- if $engines }}
{{- with .Values.huggingFaceToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $root.Values.huggingFaceToken.secretKey }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/* One Ray pod (head or worker group): restricted Pod Security profile, the router config
mounted, writable emptyDirs where Ray and vLLM write, drained before it stops. Args: root, group,
image, container. */}}
{{- define "specserve.podSpec" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- /* Worker pods run the engines; the head runs no model work. */}}
{{- $engines := ne .container "ray-head" }}
{{- $model := dict "root" $root "engines" $engines }}
{{- $grace := int (include "specserve.gracePeriodSeconds" $root) }}
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
# Long enough for the longest request to finish after the preStop drain begins.
terminationGracePeriodSeconds: {{ $grace }}
{{- if and $root.Values.modelCache.enabled $engines }}
# fsGroup does not apply on NFS-style volumes: check, as the pod's own user and without
# privilege, that the engines can write the model cache, and say what to fix when they cannot.
initContainers:
  - name: model-cache-check
    image: {{ .image }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    command:
      - sh
      - -c
      - >-
        mkdir -p "$HF_HOME" && test -w "$HF_HOME" ||
        { echo "uid $(id -u) cannot write HF_HOME=$HF_HOME on the model cache volume: let uid $(id -u) / gid $(id -g) write there (storage class parameters) (docs/kubernetes.md, Model cache)" >&2; exit 1; }
    env:
      - name: HF_HOME
        value: {{ include "specserve.hfHome" $root }}
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {memory: 64Mi}
    volumeMounts:
      {{- include "specserve.modelCacheMount" $model | nindent 6 }}
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
      {{- include "specserve.env" $model | nindent 6 }}
    resources:
      {{- toYaml $group.resources | nindent 6 }}
    {{- with $group.startupProbe }}
    startupProbe:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    # Ray Serve stops routing to this node and its requests finish before kubelet's SIGTERM,
    # which follows the hook's return; drain.stopSeconds remain for Ray to stop.
    lifecycle:
      preStop:
        exec:
          command: [specserve, drain-node, --within-s, {{ sub $grace $root.Values.drain.stopSeconds | quote }}]
    volumeMounts:
      {{- include "specserve.volumeMounts" $model | nindent 6 }}
volumes:
  {{- include "specserve.volumes" (dict "root" $root "group" $group "engines" $engines) | nindent 2 }}
{{- end }}

{{/* `drafter adapt`'s RayJob spec (adapt-rayjob.yaml), also a RayCronJob's jobTemplate. Args:
root, entrypoint, image. */}}
{{- define "specserve.adaptJobSpec" -}}
{{- $root := .root }}
# The driver runs on the head; Ray Train's workers, one per worker pod, train (docs/drafters.md).
# The submitter pod runs `ray job submit` against the head and follows the job.
submitterPodTemplate:
  metadata:
    labels:
      {{- include "specserve.selectorLabels" $root | nindent 6 }}
      app.kubernetes.io/component: adapt-submitter
  spec:
    restartPolicy: Never
    serviceAccountName: {{ include "specserve.serviceAccountName" $root }}
    automountServiceAccountToken: false
    securityContext:
      {{- toYaml $root.Values.podSecurityContext | nindent 6 }}
    containers:
      - name: ray-job-submitter
        image: {{ .image }}
        imagePullPolicy: {{ $root.Values.image.pullPolicy }}
        securityContext:
          {{- toYaml $root.Values.securityContext | nindent 10 }}
        resources:
          requests: {cpu: 100m, memory: 256Mi}
          limits: {memory: 512Mi}
        env:
          - name: HOME
            value: /home/ray
        volumeMounts:
          - {name: tmp, mountPath: /tmp}
          - {name: home, mountPath: /home/ray}
    volumes:
      - {name: tmp, emptyDir: {}}
      - {name: home, emptyDir: {}}
entrypoint: {{ .entrypoint | quote }}
shutdownAfterJobFinishes: true
ttlSecondsAfterFinished: 3600
activeDeadlineSeconds: {{ $root.Values.adapt.activeDeadlineSeconds }}
rayClusterSpec:
  rayVersion: {{ $root.Values.ray.version | quote }}
  {{- with $root.Values.ray.auth }}
  authOptions:
    mode: {{ . }}
  {{- end }}
  headGroupSpec:
    rayStartParams:
      num-cpus: "0"  # the driver recomputes features and scores; Ray Train's workers train
      dashboard-host: 0.0.0.0
    template:
      metadata:
        labels:
          {{- include "specserve.selectorLabels" $root | nindent 10 }}
          app.kubernetes.io/component: adapt-head
      spec:
        {{- include "specserve.adaptPodSpec" (dict "root" $root "container" "ray-head" "resources" $root.Values.adapt.head.resources "image" .image "loop" $root.Values.adapt.loop.enabled) | nindent 8 }}
  workerGroupSpecs:
    - groupName: train
      replicas: {{ $root.Values.adapt.workers }}
      minReplicas: {{ $root.Values.adapt.workers }}
      maxReplicas: {{ $root.Values.adapt.workers }}
      rayStartParams: {}
      template:
        metadata:
          labels:
            {{- include "specserve.selectorLabels" $root | nindent 12 }}
            app.kubernetes.io/component: adapt-worker
        spec:
          {{- include "specserve.adaptPodSpec" (dict "root" $root "container" "ray-worker" "resources" $root.Values.adapt.worker.resources "image" .image "group" $root.Values.adapt.worker) | nindent 10 }}
{{- end }}

{{- define "specserve.adaptWorkClaimName" -}}
{{- default (printf "%s-adapt-work" (include "specserve.fullname" .)) .Values.adapt.workStore.existingClaim }}
{{- end }}

{{/* A pod of `drafter adapt`'s Ray cluster: the config (for the target model), the model cache,
the capture store and adapt's work claim, no API keys and no Serve proxy. Args: root, container, resources, image,
group (worker: nodeSelector, tolerations). */}}
{{- define "specserve.adaptPodSpec" -}}
{{- $root := .root }}
{{- $gpus := int $root.Values.adapt.gpusPerWorker }}
{{- if .loop }}
# The loop's driver changes the config through the API server (rbac.yaml: the loop's account).
serviceAccountName: {{ include "specserve.loopServiceAccountName" $root }}
automountServiceAccountToken: true
{{- else }}
serviceAccountName: {{ include "specserve.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with .group }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
containers:
  - name: {{ .container }}
    image: {{ .image }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    {{- if eq .container "ray-head" }}
    ports:
      - name: gcs-server
        containerPort: 6379
      - name: dashboard
        containerPort: 8265
      - name: client
        containerPort: 10001
    {{- end }}
    env:
      - name: SPECSERVE_CONFIG
        value: /etc/specserve/config.yaml
      - name: SPECSERVE_CAPTURE_DIR
        value: {{ $root.Values.captureStore.mountPath }}
      {{- if $root.Values.modelCache.enabled }}
      - name: HF_HOME
        value: {{ include "specserve.hfHome" $root }}
      {{- end }}
      {{- with $root.Values.huggingFaceToken.secretName }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: {{ $root.Values.huggingFaceToken.secretKey }}
      {{- end }}
    resources:
      {{- $resources := deepCopy .resources }}
      {{- if and (eq .container "ray-worker") (gt $gpus 0) }}
      {{- $limits := merge (dict "nvidia.com/gpu" (toString $gpus)) (default dict $resources.limits) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- toYaml $resources | nindent 6 }}
    volumeMounts:
      - {name: tmp, mountPath: /tmp}
      - {name: home, mountPath: /home/ray}
      - {name: dshm, mountPath: /dev/shm}
      - {name: router-config, mountPath: /etc/specserve, readOnly: true}
      - {name: capture-store, mountPath: {{ $root.Values.captureStore.mountPath }}}
      - {name: adapt-work, mountPath: {{ $root.Values.adapt.workStore.mountPath }}}
      {{- if $root.Values.modelCache.enabled }}
      - {name: model-cache, mountPath: {{ $root.Values.modelCache.mountPath }}}
      {{- end }}
volumes:
  - {name: tmp, emptyDir: {}}
  - {name: home, emptyDir: {}}
  - name: dshm
    emptyDir: {medium: Memory}
  - name: router-config
    configMap:
      name: {{ include "specserve.configMapName" $root }}
  - name: capture-store
    persistentVolumeClaim:
      claimName: {{ default (printf "%s-capture" (include "specserve.fullname" $root)) $root.Values.captureStore.existingClaim }}
  # Work files (what adapt loads) on a claim no engine pod mounts.
  - name: adapt-work
    persistentVolumeClaim:
      claimName: {{ include "specserve.adaptWorkClaimName" $root }}
  {{- if $root.Values.modelCache.enabled }}
  - name: model-cache
    persistentVolumeClaim:
      claimName: {{ default (printf "%s-model-cache" (include "specserve.fullname" $root)) $root.Values.modelCache.existingClaim }}
  {{- end }}
{{- end }}

{{/* `drafter adapt` reads what the engines capture, from other pods: the store must be on and
mountable by several pods at once. */}}
{{- define "specserve.loopServiceAccountName" -}}
{{- printf "%s-loop" (include "specserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* What changing the router config takes: its ConfigMap (patched) and revision records (found
by label, created, deleted beyond the history bound or to be written again), and the
RayService's Serve config when an arm's engine changes. The config editor's Role and the loop's.
Records are named by their content, so creating and deleting them cannot be limited by name
(Kubernetes cannot limit create by name at all); patching can, to the live ConfigMap. */}}
{{- define "specserve.configEditorRules" -}}
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, create, delete]
# Patching a ConfigMap changes what some program reads: this release's router config only.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [patch]
  resourceNames: [{{ include "specserve.configMapName" . }}]
- apiGroups: [ray.io]
  resources: [rayservices]
  verbs: [list]
# Patching a RayService chooses the code its pods run: this release's only.
- apiGroups: [ray.io]
  resources: [rayservices]
  verbs: [patch]
  resourceNames: [{{ include "specserve.fullname" . }}]
{{- end }}

{{- define "specserve.validateAdapt" -}}
{{- if and .Values.adapt.loop.enabled (not .Values.adapt.loop.prometheusUrl) }}
{{- fail "adapt.loop.prometheusUrl: the loop reads the A/B verdict from a Prometheus that scrapes this release; set its URL" }}
{{- end }}
{{- if not .Values.captureStore.enabled }}
{{- fail "adapt.enabled: adapt trains on captured traffic; turn on captureStore (and capture on an arm: docs/capture.md)" }}
{{- end }}
{{- if not (has "ReadWriteMany" .Values.captureStore.accessModes) }}
{{- fail (printf "captureStore.accessModes: adapt's pods read the store the engine pods write, on other nodes: use [ReadWriteMany] (with a captureStore.storageClassName that provides it), not %s" (join "," .Values.captureStore.accessModes)) }}
{{- end }}
{{- with .Values.adapt.workStore }}
{{- if not (has "ReadWriteMany" .accessModes) }}
{{- fail (printf "adapt.workStore.accessModes: every pod of the adapt job reads and writes its work files, on other nodes: use [ReadWriteMany], not %s" (join "," .accessModes)) }}
{{- end }}
{{- if not (or .existingClaim .storageClassName $.Values.captureStore.storageClassName) }}
{{- fail "adapt.workStore.storageClassName: a ReadWriteMany claim needs a storage class that provides ReadWriteMany; name one (here or in captureStore.storageClassName), or mount a claim of your own with adapt.workStore.existingClaim" }}
{{- end }}
{{- if or (eq .mountPath $.Values.captureStore.mountPath) (hasPrefix (printf "%s/" (trimSuffix "/" $.Values.captureStore.mountPath)) .mountPath) }}
{{- fail (printf "adapt.workStore.mountPath: %s is the capture store's path or under it; give adapt's work files a path of their own" .mountPath) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The RayService's `rayClusterConfig`. Args: root, image, fingerprint (true: the worker groups'
replica counts left out, as KubeRay leaves them out when it decides whether a changed cluster spec
needs a new cluster: it applies a changed count in place under every upgrade strategy). */}}
{{/* The port of a Redis address (host:port, or redis:// / rediss:// URL); 6379 without one. */}}
{{- define "specserve.redisPort" -}}
{{- $port := regexFind ":[0-9]+$" (trimSuffix "/" (regexReplaceAll "/[0-9]*$" (trimPrefix "rediss://" (trimPrefix "redis://" .)) "")) -}}
{{- if $port }}{{ trimPrefix ":" $port }}{{ else }}6379{{ end -}}
{{- end }}

{{- define "specserve.rayClusterConfig" -}}
{{- $root := .root }}
{{- $image := .image }}
{{- $fingerprint := .fingerprint }}
rayVersion: {{ $root.Values.ray.version | quote }}
{{- with $root.Values.ray.auth }}
authOptions:
  mode: {{ . }}
{{- end }}
{{- with $root.Values.ray.gcsFaultTolerance }}
{{- if .redisAddress }}
# The cluster's state in an external Redis: a restarted head takes the running arms back.
gcsFaultToleranceOptions:
  redisAddress: {{ .redisAddress | quote }}
  {{- with .redisPasswordSecret }}
  redisPassword:
    valueFrom:
      secretKeyRef: {name: {{ .name }}, key: {{ .key }}}
  {{- end }}
{{- end }}
{{- end }}
enableInTreeAutoscaling: false
headGroupSpec:
  rayStartParams:
    {{- toYaml $root.Values.head.rayStartParams | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "specserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: ray-head
      {{- with $root.Values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "specserve.podSpec" (dict "root" $root "group" $root.Values.head "image" $image "container" "ray-head") | nindent 6 }}
workerGroupSpecs:
  {{- range $root.Values.workerGroups }}
  - groupName: {{ .name }}
    {{- if not $fingerprint }}
    replicas: {{ .replicas }}
    minReplicas: {{ default .replicas .minReplicas }}
    maxReplicas: {{ default .replicas .maxReplicas }}
    {{- end }}
    rayStartParams:
      {{- toYaml .rayStartParams | nindent 6 }}
    template:
      metadata:
        labels:
          {{- include "specserve.selectorLabels" $root | nindent 10 }}
          app.kubernetes.io/component: ray-worker
        {{- with $root.Values.podAnnotations }}
        annotations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      spec:
        {{- include "specserve.podSpec" (dict "root" $root "group" . "image" $image "container" "ray-worker") | nindent 8 }}
  {{- end }}
{{- end }}
