{{/*
Names, labels and paths of the memsifter chart. Nothing here names a stage: the steps come from the plan
(values pipeline), their stages' facts from files/stages.json (generated from the stage registry, see _stage.tpl).
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

{{/* Labels of a step's objects (RayJob, its config ConfigMap); name: its section. dict root name */}}
{{- define "memsifter.stageLabels" -}}
{{ include "memsifter.labels" .root }}
app.kubernetes.io/component: {{ .name }}
memsifter.io/stage: {{ .name }}
{{- end }}

{{/* Labels of a stage's pods. dict root name */}}
{{- define "memsifter.podLabels" -}}
{{ include "memsifter.selectorLabels" .root }}
app.kubernetes.io/component: {{ .name }}
memsifter.io/run: {{ include "memsifter.runId" .root }}
memsifter.io/stage: {{ .name }}
{{- end }}

{{/* Run id: values run.id, else the release name. */}}
{{- define "memsifter.runId" -}}
{{- default .Release.Name .Values.run.id | lower | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* The run root: the plan's (pipeline.run), else s3://bucket/runPrefix/runId */}}
{{- define "memsifter.runRoot" -}}
{{- if .Values.pipeline.run }}{{ trimSuffix "/" .Values.pipeline.run }}{{ else }}
{{- $parts := list .Values.s3.bucket }}
{{- with (trimAll "/" (.Values.s3.runPrefix | default "")) }}{{ $parts = append $parts . }}{{ end }}
{{- $parts = append $parts (include "memsifter.runId" .) }}
{{- printf "s3://%s" (join "/" $parts) }}{{ end }}
{{- end }}

{{/* Where a stage's config document is mounted in its head pod (from its ConfigMap). */}}
{{- define "memsifter.configDir" -}}/etc/memsifter{{- end }}

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

{{/* Name of a step's RayJob and of its config ConfigMap (KubeRay: <= 47 characters, DNS-1035). dict root name */}}
{{- define "memsifter.rayjobName" -}}
{{- $base := include "memsifter.fullname" .root }}
{{- if .root.Values.run.id }}{{ $base = printf "%s-%s" $base (include "memsifter.runId" .root) }}{{ end }}
{{- include "memsifter.shortName" (dict "base" $base "suffix" .name "max" 47) }}
{{- end }}

{{/* The driver Job: one per helm revision (an upgrade replaces the driver, which resumes the run). */}}
{{- define "memsifter.driverJobName" -}}
{{- include "memsifter.shortName" (dict "base" (printf "%s-driver" (include "memsifter.fullname" .)) "suffix" (printf "r%d" .Release.Revision) "max" 63) }}
{{- end }}

{{- define "memsifter.driverServiceAccount" -}}
{{- if .Values.driver.serviceAccount.create }}
{{- default (printf "%s-driver" (include "memsifter.fullname" .)) .Values.driver.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.driver.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag of a family's image; a stage's (or the driver's) image overrides it. dict root family image */}}
{{- define "memsifter.image" -}}
{{- $fam := index .root.Values.images.families .family }}
{{- $img := .image | default dict }}
{{- printf "%s:%s" (default $fam.repository $img.repository) (toString (default $fam.tag $img.tag)) }}
{{- end }}
