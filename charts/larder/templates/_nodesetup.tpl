{{/*
Files of the node setup ConfigMap: one hosts.toml per upstream and the
script that installs them. Keyed by upstream index (ConfigMap keys cannot
hold the ":" of a host:port name).
*/}}
{{- define "larder.nodeSetup.files" -}}
{{- $mirror := include "larder.mirrorURL" . }}
{{- range $i, $u := .Values.upstreams }}
upstream-{{ $i }}.hosts.toml: |
  # {{ $u.name }}: pull through larder, falling back to the registry itself.
  # Written by the {{ $.Release.Name }} release of the larder Helm chart.
  server = {{ include "larder.toml.string" $u.url }}

  [host.{{ include "larder.toml.string" $mirror }}]
    capabilities = {{ include "larder.toml.stringArray" $.Values.nodeSetup.capabilities }}
{{- end }}
install.sh: |
  #!/bin/sh
  # Installs <certs.d>/<registry>/hosts.toml for every larder upstream,
  # each by an atomic rename, so containerd never reads half a file.
  set -eu
  certs_d=/host/certs.d
  install_hosts() {
    mkdir -p "$certs_d/$1"
    cp "/config/$2" "$certs_d/$1/.hosts.toml.larder"
    mv -f "$certs_d/$1/.hosts.toml.larder" "$certs_d/$1/hosts.toml"
    echo "wrote $certs_d/$1/hosts.toml (mirror {{ $mirror }})"
  }
  {{- range $i, $u := .Values.upstreams }}
  install_hosts {{ $u.name | squote }} {{ printf "upstream-%d.hosts.toml" $i | squote }}
  {{- end }}
{{- end }}
