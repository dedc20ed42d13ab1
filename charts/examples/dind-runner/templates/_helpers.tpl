{{- define "dind-runner.fullname" -}}
{{- printf "%s-dind-runner" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of the ConfigMap with the larder sidecar's larder.toml. */}}
{{- define "dind-runner.larderName" -}}
{{- printf "%s-larder" (include "dind-runner.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}
