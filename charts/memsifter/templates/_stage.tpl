{{/*
A stage's settings, assembled from (lowest first) `common`, `multiNode` (stages that span GPU nodes),
the family's `profiles` entry, worker sizes from the stage's facts, and the stage's own block in
`stages`: each key comes from the highest layer that sets it; `resources` are merged key by key.
The facts (family, GPUs per worker, needs, input wiring, multi-node capacity) are code, not settings:
files/stages.json, generated from the stage registry by `memsifter k8s gen-chart`.
*/}}

{{- define "memsifter.facts" -}}
{{- .Files.Get "files/stages.json" }}
{{- end }}

{{/* Keys from layers (list, lowest first), each from the highest layer that has it, as JSON. dict layers keys */}}
{{- define "memsifter.pick" -}}
{{- $out := dict }}
{{- range $layer := .layers }}
{{- range $k := $.keys }}{{ if hasKey $layer $k }}{{ $_ := set $out $k (get $layer $k) }}{{ end }}{{ end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Value at a dotted path of a map, or "". dict obj path */}}
{{- define "memsifter.getPath" -}}
{{- $cur := .obj }}
{{- range (splitList "." .path) }}
{{- if kindIs "map" $cur }}{{ $cur = get $cur . }}{{ else }}{{ $cur = "" }}{{ end }}
{{- end }}
{{- $cur }}
{{- end }}

{{/* The stage's config document, as JSON: its block's `config` (only what differs from the stage's
     defaults, which stay in its pydantic model), plus `output` and, where not set, the inputs wired as
     `memsifter pipeline` wires them. The rule is not computed here: files/stages.json holds (`wiring`), per input
     field, what memsifter.pipeline.wire does for each set of its producers that run (`cases`, keyed by
     the enabled producers in order of preference); this only looks the enabled ones up and fails with the
     pipeline's refusal (two alternative producers enabled, or a required input no enabled stage makes).
     A producer's output is its own `config.output` when set. A stage that reads the memory service's URL
     (its facts' `serveUrl` field, e.g. agents' search_url) gets this release's RayService URL when
     serve.enabled and its config leaves the field out. dict root name */}}
{{- define "memsifter.stageConfig" -}}
{{- $facts := index (include "memsifter.facts" .root | fromJson) .name }}
{{- $cfg := deepCopy ((index .root.Values.stages .name | default dict).config | default dict) }}
{{- if not (get $cfg "output") }}
{{- $_ := set $cfg "output" (include "memsifter.stageOutput" .) }}
{{- end }}
{{- if and $facts.serveUrl .root.Values.serve.enabled (not (hasKey $cfg $facts.serveUrl)) }}
{{- $_ := set $cfg $facts.serveUrl (include "memsifter.serveUrl" .root) }}
{{- end }}
{{- include "memsifter.wireInputs" (dict "root" .root "cfg" $cfg "wiring" $facts.wiring) }}
{{- end }}

{{/* A config document (JSON) with its unset input fields wired from the enabled stages' outputs, by a
     wiring table of files/stages.json (or files/serve.json); see memsifter.stageConfig. dict root cfg wiring */}}
{{- define "memsifter.wireInputs" -}}
{{- $cfg := .cfg }}
{{- range $field, $in := (.wiring | default dict) }}
{{- if not (hasKey $cfg $field) }}
{{- $on := list }}
{{- range $in.from }}{{ if (index $.root.Values.stages . | default dict).enabled }}{{ $on = append $on . }}{{ end }}{{ end }}
{{- $case := index $in.cases (join "," $on) }}
{{- if kindIs "string" $case }}{{ fail $case }}{{ end }}
{{- $uris := list }}
{{- range $case }}
{{- $own := (index $.root.Values.stages . | default dict).config | default dict }}
{{- $uris = append $uris (get $own "output" | default (include "memsifter.stageOutput" (dict "root" $.root "name" .))) }}
{{- end }}
{{- if $uris }}{{ $_ := set $cfg $field (ternary $uris (first $uris) $in.list) }}{{ end }}
{{- end }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* A stage's settings as JSON: the keys of a stage block (`config`: the config document) plus `family`,
     `needs` and `capacity` ({nodes, gpusPerNode, gpusPerNodeField} read from the config, or {}). dict root name */}}
{{- define "memsifter.stage" -}}
{{- $v := .root.Values }}
{{- $f := index (include "memsifter.facts" .root | fromJson) .name }}
{{- $own := index $v.stages .name | default dict }}
{{- $cfg := include "memsifter.stageConfig" . | fromJson }}
{{- $cap := dict }}
{{- with $f.capacity }}
{{- $n := include "memsifter.getPath" (dict "obj" $cfg "path" .nodes) }}
{{- $g := include "memsifter.getPath" (dict "obj" $cfg "path" .gpusPerNode) }}
{{- $cap = dict "nodes" (int (default .defaultNodes $n)) "gpusPerNode" (int (default .defaultGpusPerNode $g)) "gpusPerNodeField" .gpusPerNode }}
{{- end }}
{{- $sizes := dict "replicas" 0 "minReplicas" 0 "maxReplicas" 0 "autoscaling" false "gpus" 0 }}
{{- if $cap }}
{{- $sizes = dict "replicas" 0 "minReplicas" 0 "maxReplicas" (max $cap.nodes 1) "autoscaling" true "gpus" $cap.gpusPerNode }}
{{- else if gt (int $f.gpus) 0 }}
{{- $sizes = dict "replicas" 1 "minReplicas" 1 "maxReplicas" 1 "autoscaling" false "gpus" (int $f.gpus) }}
{{- end }}
{{- $layers := list $v.common }}
{{- if $cap }}{{ $layers = append $layers $v.multiNode }}{{ end }}
{{- $top := list "image" "env" "runtimeEnv" "activeDeadlineSeconds" "backoffLimit" "ttlSecondsAfterFinished" "shutdownAfterJobFinishes" "capacityTimeoutSeconds" }}
{{- $s := include "memsifter.pick" (dict "layers" (append $layers $own) "keys" $top) | fromJson }}
{{- $prof := index $v.profiles $f.family | default dict }}
{{- $keys := list "resources" "shmSize" "rayStartParams" "nodeSelector" "tolerations" "affinity" }}
{{- range $group, $extra := dict "head" (list) "workers" (list "replicas" "minReplicas" "maxReplicas" "autoscaling" "gpus" "idleTimeoutSeconds") }}
{{- $mine := get $own $group | default dict }}
{{- $base := ternary $sizes (dict) (eq $group "workers") }}
{{- $gl := list $base (get $v.common $group | default dict) (get $prof $group | default dict) $mine }}
{{- $g := include "memsifter.pick" (dict "layers" $gl "keys" (concat $keys $extra)) | fromJson }}
{{- $res := mergeOverwrite (deepCopy (dig $group "resources" dict $prof)) (deepCopy ($mine.resources | default dict)) }}
{{- $_ := set $g "resources" $res }}
{{- $_ := set $s $group $g }}
{{- end }}
{{- $_ := set $s "config" $cfg }}
{{- $_ := set $s "family" $f.family }}
{{- $_ := set $s "needs" ($f.needs | default list) }}
{{- $_ := set $s "capacity" $cap }}
{{- toJson $s }}
{{- end }}

{{/* Fails when a rendered text is larger than Kubernetes stores: a ConfigMap holds at most 1 MiB (1048576 bytes:
     keys and values), and the chart keeps every other object it renders under the same bound (etcd refuses a
     request over ~1.5 MiB). A stage's config document is bounded at 256 KiB (max), so that the driver's plan,
     which holds every enabled stage's, stays within 1 MiB too. The schema bounds the strings it can; this
     catches a large value anywhere (a config field, an env value). dict what text [max] */}}
{{- define "memsifter.checkSize" -}}
{{- $max := int (.max | default 1048576) }}
{{- if gt (len .text) $max }}{{ fail (printf "%s renders %d bytes, over its bound of %d (Kubernetes stores at most 1 MiB in a ConfigMap): shorten the values that feed it" .what (len .text) $max) }}{{ end }}
{{- end }}

{{/* The settings every container of a stage reads, as JSON (env var -> value): the S3 endpoint ('' = AWS S3)
     and region. In the stage's ConfigMap beside its config document; in the driver's plan (run.settings). root */}}
{{- define "memsifter.runSettings" -}}
{{- include "memsifter.checkUrls" (dict "what" "s3.endpoint" "text" (.Values.s3.endpoint | default "")) }}
{{- toJson (dict "MEMSIFTER_S3_ENDPOINT" (.Values.s3.endpoint | default "") "AWS_REGION" .Values.s3.region) }}
{{- end }}

{{/* Fails when a rendered text holds a URL with user:password@ (a credential in a ConfigMap or object), without
     printing it: keys come from Secrets (secrets.*, serve.apiKeys, a config's *_env field). dict what text */}}
{{- define "memsifter.checkUrls" -}}
{{- if regexMatch "[A-Za-z][-A-Za-z0-9+.]*://[^/?#@\\s\"]*@" .text }}{{ fail (printf "%s: a URL with user:password@ is refused (it would be stored in the cluster in the clear): give the host only and the credential through a Secret (secrets.*, serve.apiKeys, or the config's *_env field)" .what) }}{{ end }}
{{- end }}
