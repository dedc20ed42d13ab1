{{/*
larder.toml, rendered from values. Keys follow config/full.toml.
*/}}
{{- define "larder.config" -}}
# larder configuration rendered by the {{ include "larder.chart" . }} Helm chart
# (release {{ .Release.Name }}). Edit the chart's values, not this file.

[server]
listen = {{ include "larder.toml.string" (printf "%s:%s" .Values.config.bindAddress (include "larder.registryPort" .)) }}
admin_listen = {{ include "larder.toml.string" (printf "%s:%d" .Values.config.bindAddress (.Values.ports.admin | int)) }}
# Below terminationGracePeriodSeconds ({{ .Values.terminationGracePeriodSeconds }}s){{ if gt (.Values.preStopSleepSeconds | int) 0 }} minus the preStop sleep ({{ .Values.preStopSleepSeconds }}s){{ end }}.
shutdown_grace = {{ include "larder.toml.string" .Values.config.shutdownGrace }}

[cache]
dir = "/var/lib/larder"
{{- with .Values.config.cache }}
max_size = {{ include "larder.toml.string" .maxSize }}
high_watermark = {{ include "larder.toml.float" .highWatermark }}
low_watermark = {{ include "larder.toml.float" .lowWatermark }}
memory = {{ include "larder.toml.string" .memory }}
tag_ttl = {{ include "larder.toml.string" .tagTtl }}
stale_if_error = {{ include "larder.toml.string" .staleIfError }}
{{- end }}
{{- range $u := .Values.upstreams }}

[[upstream]]
name = {{ include "larder.toml.string" .name }}
url = {{ include "larder.toml.string" .url }}
{{- if .default }}
default = true
{{- end }}
{{- with .aliases }}
aliases = {{ include "larder.toml.stringArray" . }}
{{- end }}
{{- if kindIs "bool" .libraryNamespace }}
library_namespace = {{ .libraryNamespace }}
{{- end }}
{{- with .tagTtl }}
tag_ttl = {{ include "larder.toml.string" . }}
{{- end }}
{{- with .immutableTags }}
{{- $patterns := list }}
{{- range . }}
{{- $patterns = append $patterns (include "larder.toml.regex" .) }}
{{- end }}
immutable_tags = [{{ join ", " $patterns }}]
{{- end }}
{{- with .maxConcurrency }}
max_concurrency = {{ . | int }}
{{- end }}
{{- with .connectTimeout }}
connect_timeout = {{ include "larder.toml.string" . }}
{{- end }}
{{- with .responseTimeout }}
response_timeout = {{ include "larder.toml.string" . }}
{{- end }}
{{- with .bodyIdleTimeout }}
body_idle_timeout = {{ include "larder.toml.string" . }}
{{- end }}
{{- if .caFile }}
ca_file = {{ include "larder.toml.string" .caFile }}
{{- else if .caConfigMap }}
ca_file = {{ include "larder.toml.string" (printf "/run/larder/ca/%s/%s" (include "larder.upstreamDir" .name) (default "ca.crt" .caConfigMap.key)) }}
{{- end }}
{{- with .credentials }}
username = {{ include "larder.toml.string" .username }}
password_file = {{ include "larder.toml.string" (printf "/run/secrets/larder/%s/%s" (include "larder.upstreamDir" $u.name) (default "password" .passwordKey)) }}
{{- end }}
{{- end }}
{{- if .Values.adminToken.enabled }}

[admin]
# POST /prefetch and /purge need "Authorization: Bearer <this token>".
token_file = {{ include "larder.toml.string" (include "larder.adminTokenPath" .) }}
{{- end }}
{{- end }}
