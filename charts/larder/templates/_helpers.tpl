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

{{/* "true" when larder's registry listener serves TLS (config.tls.enabled), else "". */}}
{{- define "larder.tls" -}}
{{- if .Values.config.tls.enabled }}true{{ end }}
{{- end }}

{{/* URL scheme of larder's registry API. */}}
{{- define "larder.scheme" -}}
{{- if include "larder.tls" . }}https{{ else }}http{{ end }}
{{- end }}

{{/* host:port with brackets around an IPv6 address. Call with (list HOST PORT). */}}
{{- define "larder.hostPort" -}}
{{- $host := toString (index . 0) }}
{{- if and (contains ":" $host) (not (hasPrefix "[" $host)) }}
{{- printf "[%s]:%d" $host (index . 1 | int) }}
{{- else }}
{{- printf "%s:%d" $host (index . 1 | int) }}
{{- end }}
{{- end }}

{{/*
The mirror URLs containerd is pointed at by nodeSetup, one per line, in the
order containerd tries them; "{nodeIP}" is replaced on each node by its own
IP (the pod's status.hostIP). Fails when nodes could not reach the mirror.
*/}}
{{- define "larder.mirrorURLs" -}}
{{- $scheme := include "larder.scheme" . }}
{{- if .Values.nodeSetup.mirrorURL }}
{{- include "larder.nodeSetup.checkedMirrorURL" . }}
{{- else if include "larder.nodeMode" . }}
{{- printf "%s://%s" $scheme (include "larder.hostPort" (list (default "{nodeIP}" .Values.node.hostIP) .Values.node.hostPort)) }}
{{- if .Values.node.fallbackMirror }}
{{ include "larder.serviceMirrorURL" (dict "root" . "key" "node.fallbackMirror") }}
{{- end }}
{{- else }}
{{- include "larder.serviceMirrorURL" (dict "root" . "key" "nodeSetup.enabled") }}
{{- end }}
{{- end }}

{{/*
nodeSetup.mirrorURL, checked: one http(s) URL whose host the node's own
resolver can resolve, so not a cluster DNS name (*.svc, *.<clusterDomain>):
containerd would fail to resolve it on every pull and silently fall back
to the registry.
*/}}
{{- define "larder.nodeSetup.checkedMirrorURL" -}}
{{- $url := toString .Values.nodeSetup.mirrorURL | trim }}
{{- if not (regexMatch "^https?://[^/?#\\s]+(/[^\\s]*)?$" $url) }}
{{- fail (printf "nodeSetup.mirrorURL: %q is not one http:// or https:// URL (e.g. http://10.96.0.50:5000 or http://{nodeIP}:5000)" $url) }}
{{- end }}
{{- $hostPort := regexReplaceAll "^https?://([^/?#]+).*$" $url "${1}" }}
{{- $host := regexReplaceAll ":[0-9]+$" $hostPort "" | trimSuffix "." | lower }}
{{- $domains := uniq (list (toString .Values.clusterDomain | trimSuffix "." | lower) "cluster.local") }}
{{- $cluster := or (hasSuffix ".svc" $host) (contains ".svc." $host) }}
{{- range $domains }}
{{- if or (eq $host .) (hasSuffix (printf ".%s" .) $host) }}
{{- $cluster = true }}
{{- end }}
{{- end }}
{{- if $cluster }}
{{- fail (printf "nodeSetup.mirrorURL: %q is a cluster DNS name, which containerd cannot resolve (nodes use their own resolver): pulls would silently bypass larder. Use an address nodes reach: the Service's fixed clusterIP (service.clusterIP), {nodeIP} with a NodePort or hostPort, or a name in the nodes' own DNS" $host) }}
{{- end }}
{{- $url }}
{{- end }}

{{/*
The Service as nodes reach it: its fixed cluster IP, or its NodePort on the
node's own IP. Nodes' own resolvers do not know cluster DNS names, so a
name is never used. Call with (dict "root" $ "key" "the value that needs it").
*/}}
{{- define "larder.serviceMirrorURL" -}}
{{- $v := .root.Values }}
{{- $scheme := include "larder.scheme" .root }}
{{- if and $v.service.clusterIP (ne $v.service.clusterIP "None") }}
{{- printf "%s://%s" $scheme (include "larder.hostPort" (list $v.service.clusterIP $v.service.port)) }}
{{- else if and (eq $v.service.type "NodePort") $v.service.nodePort }}
{{- printf "%s://%s" $scheme (include "larder.hostPort" (list "{nodeIP}" $v.service.nodePort)) }}
{{- else }}
{{- fail (printf "%s: containerd on the nodes needs an address of the Service it can reach without cluster DNS (nodes resolve names with their own resolver, so %s.%s.svc would silently bypass larder): set service.clusterIP to a free address of the service range, or service.type=NodePort with service.nodePort, or nodeSetup.mirrorURL" .key (include "larder.fullname" .root) .root.Release.Namespace) }}
{{- end }}
{{- end }}

{{/*
Node folders of the node setup, by nodeSetup.distribution, as YAML
(hostsDir, config, configDir); explicit values win.
*/}}
{{- define "larder.nodeSetup.paths" -}}
{{- $ns := .Values.nodeSetup }}
{{- $usrBins := list "/usr/local/sbin" "/usr/local/bin" "/usr/sbin" "/usr/bin" }}
{{- $presets := dict
  "containerd" (dict "hostsDir" "/etc/containerd/certs.d" "config" "/etc/containerd/config.toml" "binDirs" $usrBins)
  "k3s" (dict "hostsDir" "/var/lib/rancher/k3s/agent/etc/containerd/certs.d" "config" "/var/lib/rancher/k3s/agent/etc/containerd/config.toml" "binDirs" (list "/var/lib/rancher/k3s/data/current/bin"))
  "rke2" (dict "hostsDir" "/var/lib/rancher/rke2/agent/etc/containerd/certs.d" "config" "/var/lib/rancher/rke2/agent/etc/containerd/config.toml" "binDirs" (list "/var/lib/rancher/rke2/bin"))
  "talos" (dict "hostsDir" "/etc/cri/conf.d/hosts" "config" "/etc/cri/containerd.toml" "binDirs" $usrBins)
}}
{{- $p := get $presets (toString $ns.distribution) }}
{{- if not $p }}
{{- fail (printf "nodeSetup.distribution must be containerd, k3s, rke2 or talos, not %q" (toString $ns.distribution)) }}
{{- end }}
{{- $config := default $p.config $ns.containerdConfig }}
hostsDir: {{ default $p.hostsDir $ns.certsDir | trimSuffix "/" | quote }}
config: {{ $config | quote }}
configDir: {{ default (dir $config) $ns.containerdConfigDir | trimSuffix "/" | quote }}
binDirs: {{ default $p.binDirs $ns.containerdBinDirs | toJson }}
{{- end }}

{{/*
The node folders the node setup mounts (read-only) to run the node's
`containerd --version` chrooted: /usr, and each bin folder outside it.
*/}}
{{- define "larder.nodeSetup.binMounts" -}}
{{- $paths := include "larder.nodeSetup.paths" . | fromYaml }}
{{- $mounts := list "/usr" }}
{{- range $paths.binDirs }}
{{- if not (or (eq . "/usr") (hasPrefix "/usr/" .)) }}
{{- $mounts = append $mounts . }}
{{- end }}
{{- end }}
{{- $mounts | uniq | toJson }}
{{- end }}

{{/*
A size in bytes (int64): larder's units (B, KB, MB, GB, TB, KiB, MiB, GiB,
TiB) and Kubernetes quantities (k, M, G, T, Ki, Mi, Gi, Ti). Fails on
anything else. Call with (dict "value" "50Gi" "key" "persistence.size").
*/}}
{{- define "larder.bytes" -}}
{{- $v := toString .value | trim }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)? ?([kKMGT]i?B?|B)?$" $v) }}
{{- fail (printf "%s: %q is not a size like \"50Gi\" or \"40GiB\"" .key $v) }}
{{- end }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $v | float64 }}
{{- $unit := regexReplaceAll "^[0-9]+(\\.[0-9]+)? ?" $v "" | replace "B" "" | replace "K" "k" }}
{{- $factors := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 }}
{{- mulf $num (get $factors $unit) | int64 }}
{{- end }}

{{/*
A size as larder.toml spells it (a whole number and one of larder's
units, no space): "50Gi" is written "50GiB", "50G" (Kubernetes: 10^9)
"50GB", a fraction in bytes ("1.5Gi" is "1610612736B"). larder itself
refuses the lone "G" and "Gi" forms, which Kubernetes values use. Call
with (dict "value" "50Gi" "key" "config.cache.maxSize").
*/}}
{{- define "larder.size" -}}
{{- $bytes := include "larder.bytes" . }}
{{- $v := toString .value | trim }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $v }}
{{- $unit := regexReplaceAll "^[0-9]+(\\.[0-9]+)? ?" $v "" }}
{{- $units := dict "" "B" "B" "B" "k" "KB" "K" "KB" "kB" "KB" "KB" "KB" "M" "MB" "MB" "MB" "G" "GB" "GB" "GB" "T" "TB" "TB" "TB" "ki" "KiB" "Ki" "KiB" "kiB" "KiB" "KiB" "KiB" "Mi" "MiB" "MiB" "MiB" "Gi" "GiB" "GiB" "GiB" "Ti" "TiB" "TiB" "TiB" }}
{{- if and (not (contains "." $num)) (hasKey $units $unit) }}
{{- printf "%s%s" $num (get $units $unit) }}
{{- else }}
{{- printf "%sB" $bytes }}
{{- end }}
{{- end }}

{{/*
cache.max_size as written into larder.toml: config.cache.maxSize, or 85% of
the cache volume's size (the PVC, or the emptyDir's sizeLimit); on a
hostPath, whose free space the chart cannot know, it must be given.
*/}}
{{- define "larder.maxSize" -}}
{{- $c := .Values.config.cache }}
{{- $volume := include "larder.volumeSize" . }}
{{- if $c.maxSize }}
{{- $max := include "larder.bytes" (dict "value" $c.maxSize "key" "config.cache.maxSize") | int64 }}
{{- if and $volume (ge $max ($volume | int64)) }}
{{- fail (printf "config.cache.maxSize (%s) must be below the cache volume's size (%s): downloads in progress and the index come on top of it; keep it 10-20%% below" $c.maxSize (include "larder.volumeSizeText" .)) }}
{{- end }}
{{- include "larder.size" (dict "value" $c.maxSize "key" "config.cache.maxSize") }}
{{- else if $volume }}
{{- printf "%dMiB" (div (mulf ($volume | float64) 0.85 | int64) 1048576) }}
{{- else if and (include "larder.nodeMode" .) (eq .Values.node.cache.type "emptyDir") }}
{{- fail "node.cache.emptyDirSizeLimit is required with node.cache.type=emptyDir: the kubelet then evicts larder, not other pods, when the cache outgrows it (and config.cache.maxSize defaults to 85% of it)" }}
{{- else if include "larder.nodeMode" . }}
{{- fail "config.cache.maxSize is required with node.cache.type=hostPath: the cache lives on the node's own disk, which kubelet does not count for this pod (DiskPressure then evicts other pods). Give a budget the node's disk can spare, or use node.cache.type=emptyDir with node.cache.emptyDirSizeLimit" }}
{{- else }}
{{- fail "config.cache.maxSize is required when persistence.enabled=false and persistence.emptyDirSizeLimit is empty: the chart derives it from the volume's size" }}
{{- end }}
{{- end }}

{{/* Size in bytes of the cache volume when the chart knows it, else "". */}}
{{- define "larder.volumeSize" -}}
{{- $text := include "larder.volumeSizeText" . }}
{{- if $text }}{{ include "larder.bytes" (dict "value" $text "key" "cache volume size") }}{{ end }}
{{- end }}

{{- define "larder.volumeSizeText" -}}
{{- if include "larder.nodeMode" . }}
{{- if eq .Values.node.cache.type "emptyDir" }}{{ .Values.node.cache.emptyDirSizeLimit }}{{ end }}
{{- else if .Values.persistence.enabled }}{{ .Values.persistence.size }}
{{- else }}{{ .Values.persistence.emptyDirSizeLimit }}
{{- end }}
{{- end }}

{{/*
Whether, in node mode on the host network, larder's listen addresses are
the node's own IP, known only on the node: an init container then writes
the final larder.toml. "true" or "".
*/}}
{{- define "larder.runtimeConfig" -}}
{{- if and (include "larder.nodeMode" .) .Values.node.hostNetwork (not .Values.node.hostIP) }}true{{ end }}
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
{{- include "larder.validateCluster" . }}
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
{{- if eq (toString $u.clientCredentials) "verify" }}
{{- if $.Values.hub.url }}
{{- fail (printf "upstreams[%d] (%s).clientCredentials: \"verify\" checks clients with the registry itself, which a node behind hub.url never dials (and clients' credentials never go to the hub): set it on the hub's release" $i $u.name) }}
{{- end }}
{{- with $u.clientCredentialsTtl }}
{{- $_ := include "larder.durationMillis" (dict "value" . "key" (printf "upstreams[%d] (%s).clientCredentialsTtl" $i $u.name)) }}
{{- end }}
{{- if $.Values.config.auth.enabled }}
{{- fail (printf "upstreams[%d] (%s).clientCredentials: \"verify\" reads the client's Authorization header, which config.auth (htpasswd) reads too: use one of them" $i $u.name) }}
{{- end }}
{{- else if $u.clientCredentialsTtl }}
{{- fail (printf "upstreams[%d] (%s).clientCredentialsTtl applies only with clientCredentials: verify" $i $u.name) }}
{{- end }}
{{- if and $u.caFile $u.caConfigMap }}
{{- fail (printf "upstreams[%d] (%s): set caFile or caConfigMap, not both" $i $u.name) }}
{{- end }}
{{- end }}
{{- if gt $defaults 1 }}
{{- fail "upstreams: at most one upstream can have default: true" }}
{{- end }}
{{- $v := .Values }}
{{- $names := list }}
{{- range $v.upstreams }}{{ $names = append $names .name }}{{ end }}
{{- range $v.nodeSetup.excludeUpstreams }}
{{- if not (has . $names) }}
{{- fail (printf "nodeSetup.excludeUpstreams: %q is not the name of an upstream (%s)" (toString .) (join ", " $names)) }}
{{- end }}
{{- end }}
{{- /* The memory tier must fit in the pod's memory with room for request buffers. */}}
{{- $memory := include "larder.bytes" (dict "value" $v.config.cache.memory "key" "config.cache.memory") | int64 }}
{{- $mib := 1048576 }}
{{- with (($v.resources).requests).memory }}
{{- $request := include "larder.bytes" (dict "value" . "key" "resources.requests.memory") | int64 }}
{{- if gt (add $memory (mul 64 $mib)) $request }}
{{- fail (printf "config.cache.memory (%s) plus 64MiB for buffers exceeds resources.requests.memory (%s): under memory pressure larder would be evicted first. Raise the request or lower cache.memory" $v.config.cache.memory (toString .)) }}
{{- end }}
{{- end }}
{{- with (($v.resources).limits).memory }}
{{- $limit := include "larder.bytes" (dict "value" . "key" "resources.limits.memory") | int64 }}
{{- if gt (add $memory (mul 128 $mib)) $limit }}
{{- fail (printf "config.cache.memory (%s) plus 128MiB for buffers exceeds resources.limits.memory (%s): larder would be OOM-killed once the memory tier fills. Raise the limit or lower cache.memory" $v.config.cache.memory (toString .)) }}
{{- end }}
{{- end }}
{{- $_ := include "larder.maxSize" . }}
{{- if and $v.config.tls.enabled (not $v.config.tls.existingSecret) }}
{{- fail "config.tls.existingSecret is required with config.tls.enabled (a kubernetes.io/tls Secret: tls.crt, tls.key)" }}
{{- end }}
{{- if and $v.config.auth.enabled (not $v.config.auth.existingSecret) }}
{{- fail "config.auth.existingSecret is required with config.auth.enabled (a Secret with an htpasswd file of bcrypt hashes)" }}
{{- end }}
{{- if and $v.nodeSetup.enabled $v.config.auth.enabled (not $v.nodeSetup.mirrorCredentials.existingSecret) }}
{{- fail "config.auth.enabled with nodeSetup.enabled needs nodeSetup.mirrorCredentials.existingSecret: containerd would get 401 from larder and silently pull from the registries directly" }}
{{- end }}
{{- if and $v.config.auth.grants (not $v.config.auth.enabled) }}
{{- fail "config.auth.grants need config.auth.enabled: grants say what an authenticated client may pull" }}
{{- end }}
{{- with $v.nodeSetup.nodePools }}
{{- if not $v.nodeSetup.enabled }}
{{- fail "nodeSetup.nodePools need nodeSetup.enabled: they are node setup DaemonSets" }}
{{- end }}
{{- if include "larder.nodeMode" $ }}
{{- fail "nodeSetup.nodePools need mode: deployment (in node mode the larder DaemonSet itself writes hosts.toml, with nodeSetup.mirrorCredentials)" }}
{{- end }}
{{- if not $v.config.auth.enabled }}
{{- fail "nodeSetup.nodePools send per-pool credentials, which larder checks only with config.auth.enabled" }}
{{- end }}
{{- $names := list }}
{{- range . }}
{{- if has .name $names }}
{{- fail (printf "nodeSetup.nodePools: the name %q is used twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- end }}
{{- if include "larder.nodeMode" . }}
{{- if and $v.node.fallbackMirror (eq (toString $v.service.internalTrafficPolicy) "Local") }}
{{- fail "node.fallbackMirror sends pulls to the Service when the node's own larder is down; service.internalTrafficPolicy=Local would send them to that same (down) pod. Leave it empty, or use service.trafficDistribution" }}
{{- end }}
{{- if and $v.serviceMonitor.enabled $v.node.hostNetwork (not $v.node.adminOnHostIP) }}
{{- fail "serviceMonitor.enabled with node.hostNetwork: the admin port listens on 127.0.0.1 only (it serves the unauthenticated POST /purge), so Prometheus cannot scrape it. Set node.adminOnHostIP=true to listen on the node's IP, or run without hostNetwork" }}
{{- end }}
{{- if $v.podDisruptionBudget.enabled }}
{{- fail "podDisruptionBudget.enabled in node mode: a DaemonSet's pods are not evicted by drains (kubectl drain skips them), so a PodDisruptionBudget protects nothing. Turn it off" }}
{{- end }}
{{- else if $v.podDisruptionBudget.enabled }}
{{- with $v.podDisruptionBudget }}
{{- $replicas := $v.replicaCount | int }}
{{- $min := toString .minAvailable }}
{{- if and (not (kindIs "invalid" .minAvailable)) (ne $min "") }}
{{- $need := $min | int }}
{{- if regexMatch "^[0-9]+%$" $min }}
{{- /* Kubernetes rounds a percentage of minAvailable up. */}}
{{- $need = div (add (mul (trimSuffix "%" $min | int) $replicas) 99) 100 }}
{{- end }}
{{- if ge $need $replicas }}
{{- fail (printf "podDisruptionBudget.minAvailable %s with replicaCount %d never allows an eviction: node drains would hang. Use maxUnavailable: 1, or more replicas" $min $replicas) }}
{{- end }}
{{- else if regexMatch "^0%?$" (toString .maxUnavailable) }}
{{- fail "podDisruptionBudget.maxUnavailable 0 never allows an eviction: node drains would hang" }}
{{- end }}
{{- end }}
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

{{/* "true" when the admin port speaks TLS ([admin] tls = "server"). */}}
{{- define "larder.adminTLS" -}}
{{- if and .Values.config.tls.enabled .Values.config.tls.admin }}true{{ end }}
{{- end }}

{{/*
`[admin] allowed_hosts`: the names the admin API is called by, besides
loopback, localhost and the admin port's own address (larder refuses any
other Host on POST /prefetch and /purge): the admin Service's names, the
pods' names under the headless Service (deployment mode), and
config.adminAllowedHosts.
*/}}
{{- define "larder.adminAllowedHosts" -}}
{{- $admin := printf "%s-admin" (include "larder.fullname" .) }}
{{- $ns := .Release.Namespace }}
{{- $hosts := list $admin (printf "%s.%s" $admin $ns) (printf "%s.%s.svc" $admin $ns) (printf "%s.%s.svc.%s" $admin $ns .Values.clusterDomain) }}
{{- if not (include "larder.nodeMode" .) }}
{{- $headless := printf "%s-headless" (include "larder.fullname" .) }}
{{- $hosts = concat $hosts (list (printf "*.%s.%s.svc" $headless $ns) (printf "*.%s.%s.svc.%s" $headless $ns .Values.clusterDomain)) }}
{{- end }}
{{- concat $hosts (.Values.config.adminAllowedHosts | default list) | toJson }}
{{- end }}

{{/* Where the admin token is mounted in the larder container. */}}
{{- define "larder.adminTokenPath" -}}
{{- printf "/run/secrets/larder-admin/%s" .Values.adminToken.key }}
{{- end }}

{{/* Name of the Secret holding the cluster secret (created or existing). */}}
{{- define "larder.clusterSecret" -}}
{{- default (printf "%s-cluster-secret" (include "larder.fullname" . | trunc 48 | trimSuffix "-")) .Values.cluster.existingSecret }}
{{- end }}

{{/* Where the cluster secret is mounted in the larder container. */}}
{{- define "larder.clusterSecretPath" -}}
{{- printf "/run/secrets/larder-cluster/%s" .Values.cluster.secretKey }}
{{- end }}

{{/*
The headless Service the replicas find each other through: ready pods
only (publishNotReadyAddresses off: a starting replica is not yet asked),
one IP family.
*/}}
{{- define "larder.peersService" -}}
{{- printf "%s-peers" (include "larder.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/*
"true" when peers talk TLS: cluster.enabled, config.tls.enabled (its
certificate serves the peer listener too) and cluster.tls.enabled; else "".
*/}}
{{- define "larder.peerTLS" -}}
{{- if and .Values.cluster.enabled .Values.config.tls.enabled .Values.cluster.tls.enabled }}true{{ end }}
{{- end }}

{{/*
`[cluster] tls_name`: the one name every peer's certificate is verified
under, since peers are addressed by pod IP. Default: the peers' headless
Service, <fullname>-peers.<namespace>.svc.
*/}}
{{- define "larder.peerTLSName" -}}
{{- default (printf "%s.%s.svc" (include "larder.peersService" .) .Release.Namespace) .Values.cluster.tls.serverName }}
{{- end }}

{{/* `[cluster] self`: this pod's IP (expanded by larder from POD_IP) and the peer port. */}}
{{- define "larder.peerSelf" -}}
{{- $scheme := ternary "https" "http" (eq (include "larder.peerTLS" .) "true") }}
{{- if eq (toString .Values.cluster.ipFamily) "IPv6" }}
{{- printf "%s://[${POD_IP}]:%d" $scheme (.Values.cluster.port | int) }}
{{- else }}
{{- printf "%s://${POD_IP}:%d" $scheme (.Values.cluster.port | int) }}
{{- end }}
{{- end }}

{{/* Where the shared tier's access key files are mounted. */}}
{{- define "larder.sharedCredentialsDir" -}}
/run/secrets/larder-s3
{{- end }}

{{/*
Checks of the cluster, shared and hub values that the schema cannot make
(they depend on other values). Called by larder.validate.
*/}}
{{- define "larder.validateCluster" -}}
{{- $v := .Values }}
{{- if $v.cluster.enabled }}
{{- if include "larder.nodeMode" . }}
{{- fail "cluster.enabled is for deployment mode (a StatefulSet whose replicas find each other through a headless Service). Node mirrors use a cluster instead: install a deployment-mode release with cluster.enabled as the hub and set hub.url here" }}
{{- end }}
{{- $port := $v.cluster.port | int }}
{{- if or (eq $port ($v.ports.registry | int)) (eq $port ($v.ports.admin | int)) }}
{{- fail (printf "cluster.port (%d) must differ from ports.registry (%d) and ports.admin (%d): the peer listener is a listener of its own" $port ($v.ports.registry | int) ($v.ports.admin | int)) }}
{{- end }}
{{- if not (has (toString $v.cluster.ipFamily) (list "IPv4" "IPv6")) }}
{{- fail (printf "cluster.ipFamily must be IPv4 or IPv6 (the family of the pods' status.podIP), not %q" (toString $v.cluster.ipFamily)) }}
{{- end }}
{{- with $v.cluster.tls.serverName }}
{{- /* larder's rule for tls_name: a lowercase DNS name, no address, port or wildcard. */}}
{{- if or (not (regexMatch "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$" (toString .))) (regexMatch "^[0-9.]+$" (toString .)) }}
{{- fail (printf "cluster.tls.serverName: %q is not a DNS name like \"larder-peers.larder.svc\" (no address, port or wildcard): the name peers verify each other's certificate under" (toString .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- with $v.shared }}
{{- if .enabled }}
{{- if not .bucket }}
{{- fail "shared.bucket is required with shared.enabled" }}
{{- end }}
{{- if not .region }}
{{- fail "shared.region is required with shared.enabled: the store's own region name (Garage: its s3_region, often \"garage\"; AWS: the bucket's region)" }}
{{- end }}
{{- with .maxAge }}
{{- $n := regexFind "^[0-9]+" (toString .) | atoi }}
{{- $unit := regexReplaceAll "^[0-9]+" (toString .) "" }}
{{- $seconds := mul $n (get (dict "s" 1 "m" 60 "h" 3600 "d" 86400 "w" 604800) $unit | default 0) }}
{{- if lt $seconds 3600 }}
{{- fail (printf "shared.maxAge %q must be at least 1h (larder sweeps the bucket hourly, and a shorter age could delete what a replica is uploading)" (toString .)) }}
{{- end }}
{{- end }}
{{- if .credentials.existingSecret }}
{{- if eq .credentials.accessKeyIdKey .credentials.secretAccessKeyKey }}
{{- fail "shared.credentials.accessKeyIdKey and secretAccessKeyKey name the same key" }}
{{- end }}
{{- else }}
{{- $env := list }}
{{- range $v.extraEnv }}{{ $env = append $env .name }}{{ end }}
{{- if not (and (has "AWS_ACCESS_KEY_ID" $env) (has "AWS_SECRET_ACCESS_KEY" $env)) }}
{{- fail "shared.enabled needs credentials: shared.credentials.existingSecret (a Secret with the access key id and secret access key), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in extraEnv" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- with $v.hub.url }}
{{- range $v.upstreams }}
{{- if .credentials }}
{{- fail (printf "upstreams: %s has credentials, but with hub.url its requests go to the hub, which holds the credentials and fetches from the registry: leave them to the hub's release" .name) }}
{{- end }}
{{- end }}
{{- $host := regexReplaceAll ":[0-9]+$" (regexReplaceAll "/.*$" (regexReplaceAll "^https?://" . "") "") "" }}
{{- $self := include "larder.fullname" $ }}
{{- $ns := $.Release.Namespace }}
{{- if has $host (list $self (printf "%s.%s" $self $ns) (printf "%s.%s.svc" $self $ns) (printf "%s.%s.svc.%s" $self $ns $v.clusterDomain)) }}
{{- fail (printf "hub.url (%s) is this release's own Service: every request would loop back to it. Point it at another release, the cluster's hub" .) }}
{{- end }}
{{- end }}
{{- end }}
