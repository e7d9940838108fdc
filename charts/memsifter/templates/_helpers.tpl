{{/*
Helpers of the memsifter chart. Stage blocks come from values.yaml (generated from the stage registry);
nothing here names a stage.
*/}}

{{- define "memsifter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "memsifter.fullname" -}}
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

{{- define "memsifter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "memsifter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "memsifter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "memsifter.labels" -}}
helm.sh/chart: {{ include "memsifter.chart" . }}
{{ include "memsifter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: memsifter
memsifter.io/run: {{ include "memsifter.runId" . }}
{{- end }}

{{/* Run id: values run.id, else the release name. */}}
{{- define "memsifter.runId" -}}
{{- default .Release.Name .Values.run.id | lower | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* s3://bucket/runPrefix/runId */}}
{{- define "memsifter.runRoot" -}}
{{- $parts := list .Values.s3.bucket }}
{{- with (trimAll "/" (.Values.s3.runPrefix | default "")) }}{{ $parts = append $parts . }}{{ end }}
{{- $parts = append $parts (include "memsifter.runId" .) }}
{{- printf "s3://%s" (join "/" $parts) }}
{{- end }}

{{/* Output URI of a stage: dict root name */}}
{{- define "memsifter.stageOutput" -}}
{{- printf "%s/%s" (include "memsifter.runRoot" .root) .name }}
{{- end }}

{{/* DNS-1035 resource name (<= max) from a base and a suffix; long bases are cut and get a hash. */}}
{{- define "memsifter.shortName" -}}
{{- $base := regexReplaceAll "[^a-z0-9-]+" (lower .base) "-" | trimAll "-" }}
{{- if not (regexMatch "^[a-z]" $base) }}{{ $base = printf "m-%s" $base }}{{ end }}
{{- $full := printf "%s-%s" $base .suffix }}
{{- if le (len $full) (int .max) }}
{{- $full }}
{{- else }}
{{- $keep := sub (sub (int .max) (len .suffix)) 8 | int }}
{{- printf "%s-%s-%s" (trunc $keep $base | trimSuffix "-") (sha256sum $full | trunc 6) .suffix }}
{{- end }}
{{- end }}

{{/* RayJob name of a stage (KubeRay: at most 47 characters, DNS-1035). dict root name */}}
{{- define "memsifter.rayjobName" -}}
{{- $root := .root }}
{{- $base := include "memsifter.fullname" $root }}
{{- if $root.Values.run.id }}{{ $base = printf "%s-%s" $base (include "memsifter.runId" $root) }}{{ end }}
{{- include "memsifter.shortName" (dict "base" $base "suffix" .name "max" 47) }}
{{- end }}

{{/* Shell single-quoting (the entrypoint is parsed by the submitter's shell, then re-quoted by Ray). */}}
{{- define "memsifter.shquote" -}}
{{- printf "'%s'" (replace "'" "'\\''" .) }}
{{- end }}

{{/* Value at a dotted path of a map, or "" */}}
{{- define "memsifter.getPath" -}}
{{- $cur := .obj }}
{{- range (splitList "." .path) }}
{{- if kindIs "map" $cur }}{{ $cur = get $cur . }}{{ else }}{{ $cur = "" }}{{ end }}
{{- end }}
{{- $cur }}
{{- end }}

{{/* The stage config with output and wired inputs filled, as JSON. dict root name stage */}}
{{- define "memsifter.stageConfig" -}}
{{- $cfg := deepCopy (.stage.config | default dict) }}
{{- if not (get $cfg "output") }}
{{- $_ := set $cfg "output" (include "memsifter.stageOutput" (dict "root" .root "name" .name)) }}
{{- end }}
{{- range $field, $producer := (.stage.inputs | default dict) }}
{{- if not (get $cfg $field) }}
{{- if kindIs "slice" $producer }}
{{- $uris := list }}
{{- range $producer }}{{ $uris = append $uris (include "memsifter.stageOutput" (dict "root" $.root "name" .)) }}{{ end }}
{{- $_ := set $cfg $field $uris }}
{{- else }}
{{- $_ := set $cfg $field (include "memsifter.stageOutput" (dict "root" $.root "name" $producer)) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* Multi-node capacity of a stage: JSON {"nodes": n, "gpusPerNode": g} or {} */}}
{{- define "memsifter.capacity" -}}
{{- $cap := .stage.capacity }}
{{- if $cap }}
{{- $n := include "memsifter.getPath" (dict "obj" .config "path" $cap.nodes) }}
{{- $g := include "memsifter.getPath" (dict "obj" .config "path" $cap.gpusPerNode) }}
{{- toJson (dict "nodes" (int (default $cap.defaultNodes $n)) "gpusPerNode" (int (default $cap.defaultGpusPerNode $g))) }}
{{- else }}
{{- toJson dict }}
{{- end }}
{{- end }}

{{/* The command a stage's RayJob runs: memsifter run NAME --set key=<json> ... dict name config capacity stage */}}
{{- define "memsifter.entrypoint" -}}
{{- $words := list }}
{{- if .capacity.nodes }}
{{- $words = concat $words (list "memsifter" "k8s" "await-capacity" "--nodes" (toString .capacity.nodes) "--gpus-per-node" (toString .capacity.gpusPerNode) "--timeout" (toString (int .stage.capacity.waitTimeoutSeconds)) "--") }}
{{- end }}
{{- $words = concat $words (list "memsifter" "run" .name) }}
{{- range $k := keys .config | sortAlpha }}
{{- $v := get $.config $k }}
{{- if not (kindIs "invalid" $v) }}
{{- $words = append $words "--set" }}
{{- $words = append $words (include "memsifter.shquote" (printf "%s=%s" $k (toJson $v))) }}
{{- end }}
{{- end }}
{{- join " " $words }}
{{- end }}

{{- define "memsifter.image" -}}
{{- $fam := index .root.Values.images.families .family }}
{{- $repo := default $fam.repository .image.repository }}
{{- $tag := default $fam.tag .image.tag }}
{{- printf "%s:%s" $repo (toString $tag) }}
{{- end }}

{{/* Env of every Ray container: S3 settings and secrets by reference. */}}
{{- define "memsifter.env" -}}
{{- $v := .root.Values }}
- name: MEMSIFTER_RUN_ID
  value: {{ include "memsifter.runId" .root | quote }}
- name: MEMSIFTER_STAGE
  value: {{ .name | quote }}
{{- with $v.s3.endpoint }}
- name: MEMSIFTER_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: AWS_REGION
  value: {{ $v.s3.region | quote }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.s3.name }}
      key: {{ $v.secrets.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.s3.name }}
      key: {{ $v.secrets.s3.secretAccessKeyKey }}
- name: {{ $v.secrets.llm.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.llm.name }}
      key: {{ $v.secrets.llm.key }}
      optional: {{ $v.secrets.llm.optional }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.huggingFace.name }}
      key: {{ $v.secrets.huggingFace.key }}
      optional: {{ $v.secrets.huggingFace.optional }}
{{- range $v.secrets.extraEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .key }}
      optional: {{ .optional | default false }}
{{- end }}
- name: HOME
  value: {{ $v.homeVolume.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" $v.cacheVolume.mountPath | quote }}
- name: XDG_CACHE_HOME
  value: {{ $v.cacheVolume.mountPath | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" $v.cacheVolume.mountPath | quote }}
- name: VLLM_CACHE_ROOT
  value: {{ printf "%s/vllm" $v.cacheVolume.mountPath | quote }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ printf "%s/torchinductor" $v.cacheVolume.mountPath | quote }}
- name: MPLCONFIGDIR
  value: {{ printf "%s/matplotlib" $v.cacheVolume.mountPath | quote }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- with .stage.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod template of a Ray group. dict root name stage group kind(head|worker) gpu(bool) token(bool)
     token: mount the ServiceAccount token (only a head with the in-tree autoscaler needs the API). */}}
{{- define "memsifter.podTemplate" -}}
{{- $v := .root.Values }}
{{- $g := .group }}
{{- $pool := ternary $v.gpuPool $v.cpuPool .gpu }}
metadata:
  labels:
    {{- include "memsifter.selectorLabels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
    memsifter.io/run: {{ include "memsifter.runId" .root }}
    memsifter.io/stage: {{ .name }}
spec:
  automountServiceAccountToken: {{ .token }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with $v.images.pullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (ternary $pool.nodeSelector $g.nodeSelector (kindIs "invalid" $g.nodeSelector)) }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (ternary $pool.tolerations $g.tolerations (kindIs "invalid" $g.tolerations)) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (ternary $pool.affinity $g.affinity (kindIs "invalid" $g.affinity)) }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ printf "ray-%s" .kind }}
      image: {{ include "memsifter.image" (dict "root" .root "family" .stage.family "image" .stage.image) }}
      imagePullPolicy: {{ $v.images.pullPolicy }}
      securityContext:
        {{- toYaml $v.containerSecurityContext | nindent 8 }}
      env:
        {{- include "memsifter.env" . | nindent 8 }}
      {{- with $g.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        - name: cache
          mountPath: {{ $v.cacheVolume.mountPath }}
        - name: scratch
          mountPath: /tmp
        - name: home
          mountPath: {{ $v.homeVolume.mountPath }}
        {{- with $v.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $g.shmSize }}
    - name: cache
      {{- if $v.cacheVolume.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $v.cacheVolume.existingClaim }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $v.cacheVolume.sizeLimit }}
      {{- end }}
    - name: scratch
      emptyDir:
        sizeLimit: {{ $v.scratchVolume.sizeLimit }}
    - name: home
      emptyDir:
        sizeLimit: {{ $v.homeVolume.sizeLimit }}
    {{- with $v.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* KubeRay's submitter pod (K8sJobMode: a Job running `ray job submit`; KubeRay fills in the command and
     the dashboard address). Same image as the head, hardened like the Ray containers. dict root name stage */}}
{{- define "memsifter.submitterTemplate" -}}
{{- $v := .root.Values }}
metadata:
  labels:
    {{- include "memsifter.selectorLabels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
    memsifter.io/run: {{ include "memsifter.runId" .root }}
    memsifter.io/stage: {{ .name }}
    memsifter.io/role: submitter
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with $v.images.pullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.cpuPool.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.cpuPool.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-job-submitter
      image: {{ include "memsifter.image" (dict "root" .root "family" .stage.family "image" .stage.image) }}
      imagePullPolicy: {{ $v.images.pullPolicy }}
      securityContext:
        {{- toYaml $v.containerSecurityContext | nindent 8 }}
      env:
        - name: HOME
          value: /tmp
        - name: RAY_USAGE_STATS_ENABLED
          value: "0"
      {{- with $v.submitter.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
{{- end }}

{{/* A stage's RayJob. dict root name stage */}}
{{- define "memsifter.rayjob" -}}
{{- $root := .root }}
{{- $s := .stage }}
{{- $cfg := include "memsifter.stageConfig" . | fromJson }}
{{- $cap := include "memsifter.capacity" (dict "stage" $s "config" $cfg) | fromJson }}
{{- $w := $s.workers }}
{{- $gpus := int (default $w.gpus $cap.gpusPerNode) }}
{{- $maxR := int $w.maxReplicas }}
{{- if and $cap.nodes (lt $maxR (int $cap.nodes)) }}{{ $maxR = int $cap.nodes }}{{ end }}
{{- $minR := int $w.minReplicas }}
{{- $replicas := int $w.replicas }}
{{- if $w.autoscaling }}{{ $replicas = $minR }}{{ end }}
{{- if gt $minR $maxR }}{{ fail (printf "stages.%s.workers: minReplicas %d > maxReplicas %d" .name $minR $maxR) }}{{ end }}
{{- if or (lt $replicas $minR) (gt $replicas $maxR) }}{{ fail (printf "stages.%s.workers: replicas %d not within [%d, %d]" .name $replicas $minR $maxR) }}{{ end }}
{{- if and $cap.nodes (ne (int $w.gpus) (int $cap.gpusPerNode)) (gt (int $w.gpus) 0) }}{{ fail (printf "stages.%s.workers.gpus (%d) must equal config.%s (%d): each worker pod is one training node" .name (int $w.gpus) $s.capacity.gpusPerNode (int $cap.gpusPerNode)) }}{{ end }}
{{- $workerRes := deepCopy ($w.resources | default dict) }}
{{- if gt $gpus 0 }}
{{- $lim := deepCopy (get $workerRes "limits" | default dict) }}
{{- $_ := set $lim "nvidia.com/gpu" $gpus }}
{{- $_ := set $workerRes "limits" $lim }}
{{- end }}
{{- $workerGroup := merge (dict "resources" $workerRes) (omit $w "resources") }}
{{- $runtimeEnv := deepCopy ($s.runtimeEnv | default dict) }}
{{- $envVars := merge (dict "MEMSIFTER_STAGE" .name "MEMSIFTER_RUN_ID" (include "memsifter.runId" $root) "PYTHONUNBUFFERED" "1") (get $runtimeEnv "env_vars" | default dict) }}
{{- $_ := set $runtimeEnv "env_vars" $envVars }}
apiVersion: ray.io/v1
kind: RayJob
metadata:
  name: {{ include "memsifter.rayjobName" (dict "root" $root "name" .name) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "memsifter.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
    memsifter.io/stage: {{ .name }}
  annotations:
    memsifter.io/output: {{ $cfg.output | quote }}
    memsifter.io/needs: {{ join "," ($s.needs | default list) | quote }}
spec:
  entrypoint: {{ include "memsifter.entrypoint" (dict "name" .name "config" $cfg "capacity" $cap "stage" $s) | quote }}
  runtimeEnvYAML: |
    {{- toYaml $runtimeEnv | nindent 4 }}
  submissionMode: K8sJobMode
  shutdownAfterJobFinishes: {{ $s.shutdownAfterJobFinishes }}
  {{- if $s.shutdownAfterJobFinishes }}
  ttlSecondsAfterFinished: {{ int $s.ttlSecondsAfterFinished }}
  {{- end }}
  activeDeadlineSeconds: {{ int $s.activeDeadlineSeconds }}
  backoffLimit: {{ int $s.backoffLimit }}
  submitterPodTemplate:
    {{- include "memsifter.submitterTemplate" (dict "root" $root "name" .name "stage" $s) | nindent 4 }}
  rayClusterSpec:
    rayVersion: {{ $root.Values.rayVersion | quote }}
    enableInTreeAutoscaling: {{ and (gt $maxR 0) $w.autoscaling }}
    {{- if and (gt $maxR 0) $w.autoscaling }}
    autoscalerOptions:
      upscalingMode: Default
      idleTimeoutSeconds: {{ int $w.idleTimeoutSeconds }}
      imagePullPolicy: {{ $root.Values.images.pullPolicy }}
      resources:
        requests: {cpu: 500m, memory: 512Mi}
        limits: {cpu: 500m, memory: 512Mi}
      securityContext:
        {{- toYaml $root.Values.containerSecurityContext | nindent 8 }}
      env:
        - name: HOME
          value: {{ $root.Values.homeVolume.mountPath | quote }}
      volumeMounts:
        - name: scratch
          mountPath: /tmp
        - name: home
          mountPath: {{ $root.Values.homeVolume.mountPath }}
    {{- end }}
    headGroupSpec:
      rayStartParams:
        {{- toYaml ($s.head.rayStartParams | default dict) | nindent 8 }}
      template:
        {{- include "memsifter.podTemplate" (dict "root" $root "name" .name "stage" $s "group" $s.head "kind" "head" "gpu" false "token" (and (gt $maxR 0) $w.autoscaling)) | nindent 8 }}
    {{- if gt $maxR 0 }}
    workerGroupSpecs:
      - groupName: {{ ternary "gpu" "cpu" (gt $gpus 0) }}
        replicas: {{ $replicas }}
        minReplicas: {{ $minR }}
        maxReplicas: {{ $maxR }}
        rayStartParams:
          {{- toYaml ($w.rayStartParams | default dict) | nindent 10 }}
        template:
          {{- include "memsifter.podTemplate" (dict "root" $root "name" .name "stage" $s "group" $workerGroup "kind" "worker" "gpu" (gt $gpus 0) "token" false) | nindent 10 }}
    {{- end }}
{{- end }}

{{- define "memsifter.driverServiceAccount" -}}
{{- if .Values.driver.serviceAccount.create }}
{{- default (printf "%s-driver" (include "memsifter.fullname" .)) .Values.driver.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.driver.serviceAccount.name }}
{{- end }}
{{- end }}
