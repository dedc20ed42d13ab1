{{/*
The node setup: files/containerd-hosts.sh, run as an init container with
the node's containerd hosts folder (read-write) and containerd's config
folder (read-only) mounted. Everything it needs comes in environment
variables (documented at the top of the script).
*/}}

{{/* "<namespace>/<release>": the marker in every file the script writes. */}}
{{- define "larder.nodeSetup.release" -}}
{{- printf "%s/%s" .Release.Namespace .Release.Name }}
{{- end }}

{{/* "<registry> <server url>" per line, for the upstreams not excluded. */}}
{{- define "larder.nodeSetup.upstreams" -}}
{{- range .Values.upstreams }}
{{- if not (has .name ($.Values.nodeSetup.excludeUpstreams | default list)) }}
{{ .name }} {{ .url | trimSuffix "/" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The script's container. Call with (dict "root" $ "name" NAME "mode"
setup|cleanup), and "credentials" (a node pool's mirrorCredentials) to
write those instead of nodeSetup.mirrorCredentials.
*/}}
{{- define "larder.nodeSetup.container" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $paths := include "larder.nodeSetup.paths" $root | fromYaml }}
{{- $verify := and (eq .mode "setup") $v.nodeSetup.verifyContainerdConfig }}
{{- $detect := and (eq .mode "setup") (eq $v.nodeSetup.referrers "auto") }}
{{- $credentials := .credentials | default $v.nodeSetup.mirrorCredentials }}
- name: {{ .name }}
  image: {{ include "larder.nodeSetup.image" $root }}
  imagePullPolicy: {{ $v.nodeSetup.image.pullPolicy }}
  command:
    - /bin/sh
    - /opt/larder/containerd-hosts.sh
  env:
    - name: LARDER_MODE
      value: {{ .mode }}
    - name: LARDER_RELEASE
      value: {{ include "larder.nodeSetup.release" $root | quote }}
    - name: LARDER_HOSTS_DIR
      value: {{ $paths.hostsDir | quote }}
    - name: LARDER_HOSTS_MOUNT
      value: /host/containerd-hosts
    {{- if $verify }}
    - name: LARDER_CONTAINERD_CONFIG
      value: {{ $paths.config | quote }}
    - name: LARDER_CONFIG_DIR
      value: {{ $paths.configDir | quote }}
    - name: LARDER_CONFIG_MOUNT
      value: /host/containerd-config
    {{- end }}
    {{- if eq .mode "setup" }}
    - name: HOST_IP
      valueFrom:
        fieldRef:
          fieldPath: status.hostIP
    - name: LARDER_UPSTREAMS
      value: {{ include "larder.nodeSetup.upstreams" $root | trim | quote }}
    - name: LARDER_MIRRORS
      value: {{ include "larder.mirrorURLs" $root | trim | quote }}
    - name: LARDER_CAPABILITIES
      value: {{ include "larder.toml.stringArray" $v.nodeSetup.capabilities | trimPrefix "[" | trimSuffix "]" | quote }}
    - name: LARDER_REFERRERS
      value: {{ $v.nodeSetup.referrers | quote }}
    {{- if $detect }}
    - name: LARDER_NODE_ROOT
      value: /host/node
    - name: LARDER_CONTAINERD_BIN_DIRS
      value: {{ $paths.binDirs | join "\n" | quote }}
    {{- end }}
    - name: LARDER_DIAL_TIMEOUT
      value: {{ $v.nodeSetup.dialTimeout | quote }}
    - name: LARDER_EXISTING
      value: {{ $v.nodeSetup.existingHosts | quote }}
    - name: LARDER_ALLOW_PATH_LIST
      value: {{ $v.nodeSetup.allowConfigPathList | toString | quote }}
    {{- if and $v.config.tls.enabled $v.config.tls.caKey }}
    - name: LARDER_MIRROR_CA
      value: /run/larder/mirror-ca/ca.crt
    {{- end }}
    {{- if $credentials.existingSecret }}
    - name: LARDER_MIRROR_USERNAME_FILE
      value: /run/larder/mirror-credentials/username
    - name: LARDER_MIRROR_PASSWORD_FILE
      value: /run/larder/mirror-credentials/password
    {{- end }}
    {{- end }}
  # The failure reason, when there is one, shows in `kubectl describe pod`.
  terminationMessagePolicy: FallbackToLogsOnError
  # Root: containerd's folders on the node belong to root. No capabilities.
  securityContext:
    runAsNonRoot: false
    runAsUser: 0
    runAsGroup: 0
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities:
      drop:
        - ALL
      {{- if $detect }}
      # To run the node's own `containerd --version` chrooted in its /usr
      # (nodeSetup.referrers: auto).
      add:
        - SYS_CHROOT
      {{- end }}
    seccompProfile:
      type: RuntimeDefault
    {{- with $v.nodeSetup.seLinuxOptions }}
    seLinuxOptions:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  resources:
    {{- toYaml $v.nodeSetup.resources | nindent 4 }}
  volumeMounts:
    - name: node-setup-script
      mountPath: /opt/larder
      readOnly: true
    - name: node-setup-tmp
      mountPath: /tmp
    - name: containerd-hosts
      mountPath: /host/containerd-hosts
    {{- if $verify }}
    - name: containerd-config
      mountPath: /host/containerd-config
      readOnly: true
    {{- end }}
    {{- if eq .mode "setup" }}
    {{- if $detect }}
    # The node's containerd binary with its loader and libraries, read-only
    # under a root of its own (an emptyDir holding the merged-/usr links).
    - name: node-root
      mountPath: /host/node
    {{- range $i, $dir := include "larder.nodeSetup.binMounts" $root | fromJsonArray }}
    - name: node-bin-{{ $i }}
      mountPath: /host/node{{ $dir }}
      readOnly: true
    {{- end }}
    {{- end }}
    {{- if and $v.config.tls.enabled $v.config.tls.caKey }}
    - name: mirror-ca
      mountPath: /run/larder/mirror-ca
      readOnly: true
    {{- end }}
    {{- if $credentials.existingSecret }}
    - name: mirror-credentials
      mountPath: /run/larder/mirror-credentials
      readOnly: true
    {{- end }}
    {{- end }}
{{- end }}

{{/*
Volumes of the script's container (setup mode). Call with (dict "root" $),
and "credentials" as for the container.
*/}}
{{- define "larder.nodeSetup.volumes" -}}
{{- $credentials := .credentials | default .root.Values.nodeSetup.mirrorCredentials }}
{{- with .root }}
{{- $paths := include "larder.nodeSetup.paths" . | fromYaml }}
- name: node-setup-script
  configMap:
    name: {{ include "larder.nodeSetup.fullname" . }}
- name: node-setup-tmp
  emptyDir:
    sizeLimit: 16Mi
- name: containerd-hosts
  hostPath:
    path: {{ $paths.hostsDir }}
    type: DirectoryOrCreate
{{- if eq .Values.nodeSetup.referrers "auto" }}
- name: node-root
  emptyDir:
    sizeLimit: 1Mi
{{- range $i, $dir := include "larder.nodeSetup.binMounts" . | fromJsonArray }}
# Read-only: where the node's containerd binary (and its libraries) live.
- name: node-bin-{{ $i }}
  hostPath:
    path: {{ $dir }}
    type: Directory
{{- end }}
{{- end }}
{{- if .Values.nodeSetup.verifyContainerdConfig }}
# Read-only: containerd's config file and the files it imports.
- name: containerd-config
  hostPath:
    path: {{ $paths.configDir }}
    type: Directory
{{- end }}
{{- if and .Values.config.tls.enabled .Values.config.tls.caKey }}
- name: mirror-ca
  secret:
    secretName: {{ .Values.config.tls.existingSecret }}
    items:
      - key: {{ .Values.config.tls.caKey }}
        path: ca.crt
{{- end }}
{{- with $credentials }}
{{- if .existingSecret }}
- name: mirror-credentials
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: 0400
    items:
      - key: {{ .usernameKey | default "username" }}
        path: username
      - key: {{ .passwordKey | default "password" }}
        path: password
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
nodeSetup.affinity for the default node setup DaemonSet: every term also
excludes the nodes of each node pool (their own DaemonSets cover them).
*/}}
{{- define "larder.nodeSetup.defaultAffinity" -}}
{{- $affinity := deepCopy (.Values.nodeSetup.affinity | default dict) }}
{{- $excluded := list }}
{{- range .Values.nodeSetup.nodePools }}
{{- range $key, $value := .nodeSelector }}
{{- $excluded = append $excluded (dict "key" $key "operator" "NotIn" "values" (list $value)) }}
{{- end }}
{{- end }}
{{- if $excluded }}
{{- $node := $affinity.nodeAffinity | default dict }}
{{- $required := $node.requiredDuringSchedulingIgnoredDuringExecution | default dict }}
{{- $terms := list }}
{{- range ($required.nodeSelectorTerms | default (list dict)) }}
{{- $terms = append $terms (set (deepCopy .) "matchExpressions" (concat (.matchExpressions | default list) $excluded)) }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- if $affinity }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}
