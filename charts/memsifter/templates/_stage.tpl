{{/*
A step of the plan (values `pipeline`: `memsifter k8s plan`) and its settings, assembled from (lowest first)
`common`, `multiNode` (stages that span GPU nodes), the family's `profiles` entry, worker sizes from its
stage's facts, and its section's own block in `stages`: each key comes from the highest layer that sets it;
`resources` are merged key by key. The facts (family, GPUs per worker, multi-node capacity) are code, not
settings: files/stages.json, generated from the stage registry by `memsifter k8s gen-chart`. Nothing is wired
here: the plan's configs are deployed as they are.
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

{{/* The plan's steps (values `pipeline`, written by `memsifter k8s plan` from a pipeline config: the output of
     memsifter.pipeline.plan, in its order), as JSON, after checking the values around them: a plan needs its run
     root, a section is planned once, and every `stages.<name>` block (Kubernetes settings of a section) names a
     section of the plan. root */}}
{{- define "memsifter.steps" -}}
{{- $steps := .Values.pipeline.steps | default list }}
{{- $names := list }}
{{- range $steps }}
{{- if has .name $names }}{{ fail (printf "pipeline.steps: section %s is planned twice: re-generate the plan with `memsifter k8s plan`" .name) }}{{ end }}
{{- $names = append $names .name }}
{{- end }}
{{- if and $steps (not .Values.pipeline.run) }}{{ fail "pipeline.run: the plan's run root is missing: re-generate the plan with `memsifter k8s plan`" }}{{ end }}
{{- range $name, $_ := .Values.stages }}
{{- if not (has $name $names) }}{{ fail (printf "stages.%s: not a section of the plan (%s): a stages block holds the Kubernetes settings of a section that pipeline.steps runs" $name (join ", " $names | default "no steps: pipeline.steps is empty")) }}{{ end }}
{{- end }}
{{- toJson $steps }}
{{- end }}

{{/* A step's config document, as JSON: the config the plan gives it (only what its section sets, which stays
     on top of the stage's defaults in its pydantic model, plus `output` and the inputs the plan wired), as it
     is. The one key added here: a stage that reads the memory service's URL (its facts' `serveUrl` field, e.g.
     agents' search_url) gets this release's RayService URL when serve.enabled and its config leaves the field
     out (a plan made without a cluster cannot know it). dict root step */}}
{{- define "memsifter.stageConfig" -}}
{{- $facts := index (include "memsifter.facts" .root | fromJson) .step.stage }}
{{- $cfg := deepCopy (.step.config | default dict) }}
{{- if and $facts.serveUrl .root.Values.serve.enabled (not (hasKey $cfg $facts.serveUrl)) }}
{{- $_ := set $cfg $facts.serveUrl (include "memsifter.serveUrl" .root) }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* A step's settings as JSON: the keys of its section's block (stages.<name>) plus `config` (the config
     document), `family`, `stage` and `capacity` ({nodes, gpusPerNode, gpusPerNodeField} read from the config,
     or {}). dict root name step */}}
{{- define "memsifter.stage" -}}
{{- $v := .root.Values }}
{{- $f := index (include "memsifter.facts" .root | fromJson) .step.stage }}
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
{{- $_ := set $s "stage" .step.stage }}
{{- $_ := set $s "capacity" $cap }}
{{- toJson $s }}
{{- end }}

{{/* Fails when a rendered text is larger than Kubernetes stores: a ConfigMap holds at most 1 MiB (1048576 bytes:
     keys and values), and the chart keeps every other object it renders under the same bound (etcd refuses a
     request over ~1.5 MiB). A stage's config document is bounded at 256 KiB (max), so that the driver's plan,
     which holds every step's, stays within 1 MiB too. The schema bounds the strings it can; this
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
