{{/*
Names, labels and the small renderers the templates share.
*/}}

{{/* Chart name, overridable. */}}
{{- define "larder.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart>, or the release name alone when it already
contains the chart name. Truncated to 63 characters (DNS label).
*/}}
{{- define "larder.fullname" -}}
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

{{/* Name of the node setup objects (<fullname>-node-setup). */}}
{{- define "larder.nodeSetup.fullname" -}}
{{- printf "%s-node-setup" (include "larder.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}

{{/* Chart label value: name-version. */}}
{{- define "larder.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels. Call with (dict "root" $ "component" "mirror") or
(dict "root" $ "component" "node-setup"): the component keeps the Service,
PodDisruptionBudget and workloads from selecting each other's pods.
*/}}
{{- define "larder.selectorLabels" -}}
app.kubernetes.io/name: {{ include "larder.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Common labels: selector labels plus chart metadata. Same argument. */}}
{{- define "larder.labels" -}}
helm.sh/chart: {{ include "larder.chart" .root }}
{{ include "larder.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: larder
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "larder.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "larder.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* larder image reference; the tag defaults to the chart's appVersion. */}}
{{- define "larder.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/* node setup image reference. */}}
{{- define "larder.nodeSetup.image" -}}
{{- printf "%s:%s" .Values.nodeSetup.image.repository (.Values.nodeSetup.image.tag | toString) }}
{{- end }}

{{/* Whether the chart runs in node mode ("true" or ""). Fails on an unknown mode. */}}
{{- define "larder.nodeMode" -}}
{{- if eq .Values.mode "node" }}true
{{- else if ne .Values.mode "deployment" }}
{{- fail (printf "mode must be \"deployment\" or \"node\", not %q" (toString .Values.mode)) }}
{{- end }}
{{- end }}

{{/*
The registry port larder listens on. On the host network the container
port is the host port, so node.hostPort wins there.
*/}}
{{- define "larder.registryPort" -}}
{{- if and (include "larder.nodeMode" .) .Values.node.hostNetwork }}
{{- .Values.node.hostPort | int }}
{{- else }}
{{- .Values.ports.registry | int }}
{{- end }}
{{- end }}

{{/*
The mirror URL containerd is pointed at by nodeSetup (see values.yaml).
*/}}
{{- define "larder.mirrorURL" -}}
{{- if .Values.nodeSetup.mirrorURL }}
{{- .Values.nodeSetup.mirrorURL }}
{{- else if include "larder.nodeMode" . }}
{{- printf "http://127.0.0.1:%d" (.Values.node.hostPort | int) }}
{{- else if and .Values.service.clusterIP (ne .Values.service.clusterIP "None") }}
{{- printf "http://%s:%d" .Values.service.clusterIP (.Values.service.port | int) }}
{{- else }}
{{- printf "http://%s.%s.svc.cluster.local:%d" (include "larder.fullname" .) .Release.Namespace (.Values.service.port | int) }}
{{- end }}
{{- end }}

{{/*
A TOML basic string: "…" with backslashes, quotes and control characters
escaped.
*/}}
{{- define "larder.toml.string" -}}
{{- $s := toString . }}
{{- $s = $s | replace "\\" "\\\\" | replace "\"" "\\\"" }}
{{- $s = $s | replace "\n" "\\n" | replace "\r" "\\r" | replace "\t" "\\t" }}
{{- printf "\"%s\"" $s }}
{{- end }}

{{/*
A TOML string for a regular expression: a literal string '…' (backslashes
kept as they are) unless it contains a single quote or a control
character, then an escaped basic string.
*/}}
{{- define "larder.toml.regex" -}}
{{- $s := toString . }}
{{- if regexMatch "['\\x00-\\x1f\\x7f]" $s }}
{{- include "larder.toml.string" $s }}
{{- else }}
{{- printf "'%s'" $s }}
{{- end }}
{{- end }}

{{/* A TOML array of basic strings. */}}
{{- define "larder.toml.stringArray" -}}
{{- $items := list }}
{{- range . }}
{{- $items = append $items (include "larder.toml.string" .) }}
{{- end }}
{{- printf "[%s]" (join ", " $items) }}
{{- end }}

{{/* A TOML float: always with a decimal point (1 → 1.0), since larder's watermarks are floats. */}}
{{- define "larder.toml.float" -}}
{{- $s := toString . }}
{{- if not (regexMatch "^-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?$" $s) }}
{{- fail (printf "%q is not a number" $s) }}
{{- end }}
{{- if regexMatch "[.eE]" $s }}{{ $s }}{{ else }}{{ $s }}.0{{ end }}
{{- end }}

{{/*
A duration of the form <number><unit> (ms, s, m, h) in milliseconds. Fails
on anything else, naming the value key.
Call with (dict "value" "25s" "key" "config.shutdownGrace").
*/}}
{{- define "larder.durationMillis" -}}
{{- $v := toString .value | trim }}
{{- $m := regexFindAll "^([0-9]+)(ms|s|m|h)$" $v -1 }}
{{- if not $m }}
{{- fail (printf "%s: %q must be a number and one unit: 500ms, 25s, 1m, 1h" .key $v) }}
{{- end }}
{{- $n := regexFind "^[0-9]+" $v | atoi }}
{{- $unit := regexReplaceAll "^[0-9]+" $v "" }}
{{- $factor := get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit }}
{{- mul $n $factor }}
{{- end }}

{{/*
Folder name for an upstream's mounted files (secrets, CA): its name with
":" (a port) replaced by "_".
*/}}
{{- define "larder.upstreamDir" -}}
{{- . | replace ":" "_" }}
{{- end }}

{{/* Checks on values that a schema cannot express. Renders nothing. */}}
{{- define "larder.validate" -}}
{{- $_ := include "larder.nodeMode" . }}
{{- if not .Values.upstreams }}
{{- fail "upstreams: larder needs at least one upstream" }}
{{- end }}
{{- $defaults := 0 }}
{{- range $i, $u := .Values.upstreams }}
{{- if not (and $u.name $u.url) }}
{{- fail (printf "upstreams[%d]: name and url are required" $i) }}
{{- end }}
{{- /* Same rule as larder's: a lowercase host name, maybe with a port. It is
       also a folder name on the node and a word in the node setup script. */}}
{{- range prepend ($u.aliases | default list) $u.name }}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?$" (toString .)) }}
{{- fail (printf "upstreams[%d]: %q is not a registry host name like \"ghcr.io\"" $i (toString .)) }}
{{- end }}
{{- end }}
{{- if not (regexMatch "^https?://[^/?#]+/?$" (toString $u.url)) }}
{{- fail (printf "upstreams[%d] (%s).url: %q must be http(s)://host[:port] with no path" $i $u.name (toString $u.url)) }}
{{- end }}
{{- if $u.default }}{{ $defaults = add1 $defaults }}{{ end }}
{{- with $u.credentials }}
{{- if not .existingSecret }}
{{- fail (printf "upstreams[%d] (%s).credentials.existingSecret is required" $i $u.name) }}
{{- end }}
{{- if not .username }}
{{- fail (printf "upstreams[%d] (%s).credentials.username is required: larder takes the username literally from its config (there is no username_file); only the password comes from the Secret" $i $u.name) }}
{{- end }}
{{- end }}
{{- if and $u.caFile $u.caConfigMap }}
{{- fail (printf "upstreams[%d] (%s): set caFile or caConfigMap, not both" $i $u.name) }}
{{- end }}
{{- end }}
{{- if gt $defaults 1 }}
{{- fail "upstreams: at most one upstream can have default: true" }}
{{- end }}
{{- $grace := include "larder.durationMillis" (dict "value" .Values.config.shutdownGrace "key" "config.shutdownGrace") | int64 }}
{{- $budget := mul (sub (.Values.terminationGracePeriodSeconds | int64) (.Values.preStopSleepSeconds | int64)) 1000 }}
{{- if ge $grace $budget }}
{{- fail (printf "config.shutdownGrace (%s) must be shorter than terminationGracePeriodSeconds (%d) minus preStopSleepSeconds (%d): the kubelet kills larder when that runs out" (toString .Values.config.shutdownGrace) (.Values.terminationGracePeriodSeconds | int) (.Values.preStopSleepSeconds | int)) }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the admin token (created or existing). */}}
{{- define "larder.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "larder.fullname" . | trunc 51 | trimSuffix "-")) .Values.adminToken.existingSecret }}
{{- end }}

{{/* Where the admin token is mounted in the larder container. */}}
{{- define "larder.adminTokenPath" -}}
{{- printf "/run/secrets/larder-admin/%s" .Values.adminToken.key }}
{{- end }}
