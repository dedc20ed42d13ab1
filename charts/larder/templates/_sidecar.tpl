{{/*
larder as a sidecar in another chart's pod (a DinD or BuildKit CI runner,
a build pod): the workload pulls through http://127.0.0.1:<ports.registry>.
Another chart gets these templates from the larder-sidecar library chart
(charts/larder-sidecar, which shares this file, _helpers.tpl, _config.tpl
and values.yaml with this chart), declared with `alias: larder`, so its
values live under `larder:` with all of this chart's defaults.

Every template takes one dict:
  root    the including chart's context ($)
  values  larder's values ($.Values.larder)
  name    the name of the ConfigMap holding larder.toml (and a prefix for
          the pod's volume names stays fixed: larder-config, larder-cache,
          larder-tmp)

  larder.sidecar.configMap   a ConfigMap with larder.toml
  larder.sidecar.container   the larder container (a mapping; put it in
                             initContainers when values.sidecar.native)
  larder.sidecar.volumes     the pod volumes it needs (list items)
  larder.sidecar.mirrorURL   http://127.0.0.1:<port>, for the workload

See charts/examples/dind-runner for a parent chart that uses all four.
*/}}

{{/* The context larder's own templates expect, with the sidecar's listeners. */}}
{{- define "larder.sidecar.context" -}}
{{- $v := deepCopy .values }}
{{- /* A sidecar is one pod's own cache: no peers, and no shared-tier
       credentials mounted (hub.url works: it is config only). */}}
{{- if or ($v.cluster).enabled ($v.shared).enabled }}
{{- fail "cluster.enabled and shared.enabled are not for the larder sidecar (one pod's own cache, with no peers and no mounted store credentials): point it at a cluster's larder with hub.url instead" }}
{{- end }}
{{- $_ := set $v "mode" "deployment" }}
{{- /* Keep-warm is the cluster's larder's job: the sidecar mounts no warm file. */}}
{{- $_ := set $v "warm" (dict "images" (list) "interval" "") }}
{{- $token := deepCopy $v.adminToken }}
{{- $_ := set $token "enabled" false }}
{{- $_ := set $v "adminToken" $token }}
{{- $chart := .root.Chart }}
{{- with .root.Subcharts }}{{ with .larder }}{{ $chart = .Chart }}{{ end }}{{ end }}
{{- toYaml (dict "Values" $v "ChartAppVersion" $chart.AppVersion) }}
{{- end }}

{{/* larder.toml for the sidecar. */}}
{{- define "larder.sidecar.config" -}}
{{- $ctx := include "larder.sidecar.context" . | fromYaml }}
{{- $v := $ctx.Values }}
{{- $toml := include "larder.config" (dict "Values" $v "Release" .root.Release "Chart" .root.Chart) }}
{{- /* Two addresses: the registry port on loopback (only this pod's
       containers), the admin port on config.bindAddress (the kubelet's
       probes and Prometheus reach a pod on its IP). larder.config writes
       one bind address for both, so the registry line is rewritten here. */}}
{{- $registry := printf "listen = %s" (include "larder.toml.string" (printf "%s:%d" $v.sidecar.registryBindAddress ($v.ports.registry | int))) }}
{{- regexReplaceAll "(?m)^listen = .*$" $toml $registry }}
{{- end }}

{{- define "larder.sidecar.configMap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    app.kubernetes.io/name: larder
    app.kubernetes.io/instance: {{ .root.Release.Name }}
    app.kubernetes.io/component: sidecar
    app.kubernetes.io/managed-by: {{ .root.Release.Service }}
data:
  larder.toml: |
    {{- include "larder.sidecar.config" . | nindent 4 }}
{{- end }}

{{- define "larder.sidecar.mirrorURL" -}}
{{- printf "http://127.0.0.1:%d" (.values.ports.registry | int) }}
{{- end }}

{{- define "larder.sidecar.container" -}}
{{- $ctx := include "larder.sidecar.context" . | fromYaml }}
{{- $v := $ctx.Values -}}
name: larder
image: {{ printf "%s:%s" $v.image.repository (default $ctx.ChartAppVersion $v.image.tag | toString) }}
imagePullPolicy: {{ $v.image.pullPolicy }}
{{- if $v.sidecar.native }}
# A native sidecar: started before the workload, stopped after it.
restartPolicy: Always
{{- end }}
args:
  - --config
  - /etc/larder/larder.toml
  - --log-format
  - {{ $v.logFormat }}
env:
  - name: RUST_LOG
    value: {{ $v.logLevel | quote }}
  {{- with $v.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: larder-admin
    containerPort: {{ $v.ports.admin }}
    protocol: TCP
startupProbe:
  httpGet:
    path: /healthz
    port: larder-admin
    {{- if and $v.config.tls.enabled $v.config.tls.admin }}
    scheme: HTTPS
    {{- end }}
  {{- toYaml $v.startupProbe | nindent 2 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: larder-admin
    {{- if and $v.config.tls.enabled $v.config.tls.admin }}
    scheme: HTTPS
    {{- end }}
  {{- toYaml $v.livenessProbe | nindent 2 }}
readinessProbe:
  httpGet:
    path: /readyz
    port: larder-admin
    {{- if and $v.config.tls.enabled $v.config.tls.admin }}
    scheme: HTTPS
    {{- end }}
  {{- toYaml $v.readinessProbe | nindent 2 }}
resources:
  {{- toYaml $v.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.securityContext | nindent 2 }}
volumeMounts:
  - name: larder-config
    mountPath: /etc/larder
    readOnly: true
  - name: larder-cache
    mountPath: /var/lib/larder
  - name: larder-tmp
    mountPath: /tmp
  {{- range $i, $u := $v.upstreams }}
  {{- if $u.credentials }}
  - name: {{ printf "larder-upstream-%d-credentials" $i }}
    mountPath: {{ printf "/run/secrets/larder/%s" (include "larder.upstreamDir" $u.name) }}
    readOnly: true
  {{- end }}
  {{- end }}
{{- end }}

{{- define "larder.sidecar.volumes" -}}
{{- $v := (include "larder.sidecar.context" . | fromYaml).Values -}}
- name: larder-config
  configMap:
    name: {{ .name }}
- name: larder-tmp
  emptyDir:
    sizeLimit: 64Mi
- name: larder-cache
  {{- if $v.sidecar.cache.claimName }}
  persistentVolumeClaim:
    claimName: {{ $v.sidecar.cache.claimName }}
  {{- else }}
  emptyDir:
    {{- with $v.sidecar.cache.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
  {{- end }}
{{- range $i, $u := $v.upstreams }}
{{- with $u.credentials }}
- name: {{ printf "larder-upstream-%d-credentials" $i }}
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: 0444
    items:
      - key: {{ default "password" .passwordKey }}
        path: {{ default "password" .passwordKey }}
{{- end }}
{{- end }}
{{- end }}
