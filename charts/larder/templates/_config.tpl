{{/*
larder.toml, rendered from values. Keys follow config/full.toml.
*/}}
{{- define "larder.config" -}}
# larder configuration rendered by the {{ include "larder.chart" . }} Helm chart
# (release {{ .Release.Name }}). Edit the chart's values, not this file.

[server]
{{- $node := include "larder.nodeMode" . }}
{{- $registryPort := include "larder.registryPort" . | int }}
{{- if and $node .Values.node.hostNetwork }}
{{- if .Values.node.hostIP }}
# On the host network: the registry API on node.hostIP only.
listen = {{ include "larder.toml.string" (include "larder.hostPort" (list .Values.node.hostIP $registryPort)) }}
{{- else }}
# On the host network: the registry API on the node's own IP only. This pod's
# init container writes that IP here when the pod starts.
listen = {{ include "larder.toml.string" (include "larder.hostPort" (list "127.0.0.1" $registryPort)) }}
{{- end }}
{{- if .Values.node.adminOnHostIP }}
admin_listen = {{ include "larder.toml.string" (include "larder.hostPort" (list (default "127.0.0.1" .Values.node.hostIP) .Values.ports.admin)) }}
{{- else }}
# The admin port (POST /purge, /prefetch) stays on the node's loopback.
admin_listen = {{ include "larder.toml.string" (include "larder.hostPort" (list "127.0.0.1" .Values.ports.admin)) }}
{{- end }}
{{- else }}
listen = {{ include "larder.toml.string" (printf "%s:%d" .Values.config.bindAddress $registryPort) }}
admin_listen = {{ include "larder.toml.string" (printf "%s:%d" .Values.config.bindAddress (.Values.ports.admin | int)) }}
{{- end }}
# Below terminationGracePeriodSeconds ({{ .Values.terminationGracePeriodSeconds }}s){{ if gt (.Values.preStopSleepSeconds | int) 0 }} minus the preStop sleep ({{ .Values.preStopSleepSeconds }}s){{ end }}.
shutdown_grace = {{ include "larder.toml.string" .Values.config.shutdownGrace }}
{{- if .Values.config.tls.enabled }}

# From Secret {{ .Values.config.tls.existingSecret }}; re-read when it changes (no restart).
[server.tls]
cert = "/run/larder/tls/tls.crt"
key = "/run/larder/tls/tls.key"
{{- end }}
{{- if .Values.config.auth.enabled }}

# From Secret {{ .Values.config.auth.existingSecret }}; re-read when it changes (no restart).
[server.auth]
htpasswd = "/run/larder/auth/htpasswd"
realm = {{ include "larder.toml.string" .Values.config.auth.realm }}
{{- range .Values.config.auth.grants }}

[[server.auth.grant]]
who = {{ include "larder.toml.stringArray" .who }}
{{- if hasKey . "upstreams" }}
upstreams = {{ include "larder.toml.stringArray" .upstreams }}
{{- end }}
{{- if hasKey . "repositories" }}
repositories = {{ include "larder.toml.stringArray" .repositories }}
{{- end }}
{{- end }}
{{- end }}

[cache]
dir = "/var/lib/larder"
{{- with .Values.config.cache }}
max_size = {{ include "larder.toml.string" (include "larder.maxSize" $) }}
high_watermark = {{ include "larder.toml.float" .highWatermark }}
low_watermark = {{ include "larder.toml.float" .lowWatermark }}
memory = {{ include "larder.toml.string" (include "larder.size" (dict "value" .memory "key" "config.cache.memory")) }}
tag_ttl = {{ include "larder.toml.string" .tagTtl }}
stale_if_error = {{ include "larder.toml.string" .staleIfError }}
{{- end }}
{{- with .Values.warm }}
{{- if .images }}
# warm.images, from ConfigMap {{ include "larder.fullname" $ }}-warm; re-read when it changes (no restart).
warm_file = "/run/larder/warm/warm.txt"
{{- end }}
{{- with .interval }}
warm_interval = {{ include "larder.toml.string" . }}
{{- end }}
{{- end }}
{{- range $u := .Values.upstreams }}

[[upstream]]
name = {{ include "larder.toml.string" .name }}
url = {{ include "larder.toml.string" .url }}
{{- with $.Values.hub.url }}
# Through the hub: requests go there with ?ns={{ $u.name }}, never to url.
via = {{ include "larder.toml.string" . }}
{{- end }}
{{- if .default }}
default = true
{{- end }}
{{- with .aliases }}
aliases = {{ include "larder.toml.stringArray" . }}
{{- end }}
{{- if kindIs "bool" .libraryNamespace }}
library_namespace = {{ .libraryNamespace }}
{{- end }}
{{- with .maxSize }}
# This upstream's share of the cache: its least recently used content goes first.
max_size = {{ include "larder.toml.string" (include "larder.size" (dict "value" . "key" (printf "upstreams[%s].maxSize" $u.name))) }}
{{- end }}
{{- with .maxBandwidth }}
# Bytes per second for all this upstream's downloads; clients' first.
max_bandwidth = {{ include "larder.toml.string" (include "larder.size" (dict "value" . "key" (printf "upstreams[%s].maxBandwidth" $u.name))) }}
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
{{- if eq (toString .clientCredentials) "verify" }}
# Every client's own credentials are checked with this upstream before anything of it is served.
client_credentials = "verify"
{{- with .clientCredentialsTtl }}
client_credentials_ttl = {{ include "larder.toml.string" . }}
{{- end }}
{{- end }}
{{- with .credentials }}
username = {{ include "larder.toml.string" .username }}
password_file = {{ include "larder.toml.string" (printf "/run/secrets/larder/%s/%s" (include "larder.upstreamDir" $u.name) (default "password" .passwordKey)) }}
{{- end }}
{{- end }}

{{- /* POST /prefetch and /purge can be used with a token file, or on a
       loopback admin port (larder then writes a token of its own); otherwise
       larder refuses them and allowed_hosts has nothing to guard. */}}
{{- $operable := or .Values.adminToken.enabled (and $node .Values.node.hostNetwork (not .Values.node.adminOnHostIP)) }}
{{- if or $operable .Values.config.tls.enabled }}

[admin]
{{- end }}
{{- if .Values.adminToken.enabled }}
# POST /prefetch and /purge need "Authorization: Bearer <this token>".
token_file = {{ include "larder.toml.string" (include "larder.adminTokenPath" .) }}
{{- end }}
{{- if $operable }}
# Besides loopback, localhost and the admin port's own address, the only
# names POST /prefetch and /purge may be addressed to (DNS rebinding defence).
allowed_hosts = {{ include "larder.adminAllowedHosts" . }}
{{- end }}
{{- if and .Values.config.tls.enabled (not .Values.config.tls.admin) }}
# Plain HTTP on the admin port although the registry port is HTTPS (config.tls.admin=false).
tls = "off"
{{- else if .Values.config.tls.enabled }}
# The admin port serves HTTPS with the same certificate (the default with [server.tls]).
tls = "server"
{{- end }}
{{- with .Values.shared }}
{{- if .enabled }}

[shared]
{{- $prefix := .prefix | trimAll "/" }}
url = {{ include "larder.toml.string" (printf "s3://%s%s" .bucket (ternary (printf "/%s" $prefix) "" (ne $prefix ""))) }}
{{- with .endpoint }}
endpoint = {{ include "larder.toml.string" (trimSuffix "/" .) }}
{{- end }}
region = {{ include "larder.toml.string" .region }}
{{- if .credentials.existingSecret }}
# From Secret {{ .credentials.existingSecret }}.
access_key_id_file = {{ include "larder.toml.string" (printf "%s/%s" (include "larder.sharedCredentialsDir" $) .credentials.accessKeyIdKey) }}
secret_access_key_file = {{ include "larder.toml.string" (printf "%s/%s" (include "larder.sharedCredentialsDir" $) .credentials.secretAccessKeyKey) }}
{{- else }}
# Credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from extraEnv.
{{- end }}
{{- with .maxAge }}
max_age = {{ include "larder.toml.string" . }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.tracing }}
{{- if .otlpEndpoint }}

# OpenTelemetry traces over OTLP/HTTP (tracing.* values).
[tracing]
otlp_endpoint = {{ include "larder.toml.string" .otlpEndpoint }}
sampling_ratio = {{ include "larder.toml.float" .samplingRatio }}
{{- with .serviceName }}
service_name = {{ include "larder.toml.string" . }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.cluster.enabled }}

[cluster]
# The peer listener: listed by {{ include "larder.peersService" . }} only, not by the client Service.
listen = {{ include "larder.toml.string" (printf "%s:%d" .Values.config.bindAddress (.Values.cluster.port | int)) }}
# POD_IP is status.podIP, from the pod's environment.
self = {{ include "larder.toml.string" (include "larder.peerSelf" .) }}
# Ready replicas, from the headless Service; resolved again every 5 s.
peers_dns = {{ include "larder.toml.string" (printf "%s.%s.svc.%s:%d" (include "larder.peersService" .) .Release.Namespace .Values.clusterDomain (.Values.cluster.port | int)) }}
secret_file = {{ include "larder.toml.string" (include "larder.clusterSecretPath" .) }}
{{- if include "larder.peerTLS" . }}
# Peers talk TLS with config.tls's certificate (Secret {{ .Values.config.tls.existingSecret }}), verified under
# this name, not the pod IPs: the certificate must carry it as a DNS name.
tls_name = {{ include "larder.toml.string" (include "larder.peerTLSName" .) }}
{{- if .Values.config.tls.caKey }}
# The CA that signed it: key {{ .Values.config.tls.caKey }} of the same Secret.
ca_file = "/run/larder/tls/ca.crt"
{{- end }}
{{- end }}
{{- end }}
{{- end }}
