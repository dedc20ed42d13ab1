{{/*
The larder pod template, shared by the StatefulSet (deployment mode) and
the DaemonSet (node mode).
*/}}
{{- define "larder.podTemplate" -}}
{{- $node := include "larder.nodeMode" . -}}
metadata:
  labels:
    {{- include "larder.labels" (dict "root" . "component" "mirror") | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Restart pods when larder.toml changes (larder reads it at start).
    checksum/config: {{ include "larder.config" . | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "larder.serviceAccountName" . }}
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if and $node .Values.node.hostNetwork }}
  hostNetwork: true
  # Still resolve cluster names (e.g. an in-cluster upstream registry).
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- if and $node (eq .Values.node.cache.type "hostPath") .Values.node.cache.fixPermissions }}
  initContainers:
    # fsGroup does not apply to hostPath volumes: hand the cache folder to
    # larder's user once, as root, with only the CHOWN capability.
    - name: cache-permissions
      image: {{ include "larder.nodeSetup.image" . }}
      imagePullPolicy: {{ .Values.nodeSetup.image.pullPolicy }}
      # Recursive only when the folder's owner is not yet right (a new
      # folder, or a changed runAsUser).
      command:
        - /bin/sh
        - -c
        - {{ printf "owner=%d:%d; [ \"$(stat -c %%u:%%g /var/lib/larder)\" = \"$owner\" ] || chown -R \"$owner\" /var/lib/larder" (.Values.podSecurityContext.runAsUser | default 65532 | int) (.Values.podSecurityContext.fsGroup | default 65532 | int) | quote }}
      securityContext:
        runAsNonRoot: false
        runAsUser: 0
        runAsGroup: 0
        readOnlyRootFilesystem: true
        allowPrivilegeEscalation: false
        capabilities:
          drop:
            - ALL
          add:
            - CHOWN
        seccompProfile:
          type: RuntimeDefault
      resources:
        {{- toYaml .Values.nodeSetup.resources | nindent 8 }}
      volumeMounts:
        - name: cache
          mountPath: /var/lib/larder
  {{- end }}
  containers:
    - name: larder
      image: {{ include "larder.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - --config
        - /etc/larder/larder.toml
        - --log-format
        - {{ .Values.logFormat }}
      env:
        - name: RUST_LOG
          value: {{ .Values.logLevel | quote }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: registry
          containerPort: {{ include "larder.registryPort" . }}
          {{- if $node }}
          hostPort: {{ .Values.node.hostPort }}
          {{- end }}
          protocol: TCP
        - name: admin
          containerPort: {{ .Values.ports.admin }}
          protocol: TCP
      startupProbe:
        httpGet:
          path: /healthz
          port: admin
        {{- toYaml .Values.startupProbe | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: admin
        {{- toYaml .Values.livenessProbe | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: admin
        {{- toYaml .Values.readinessProbe | nindent 8 }}
      {{- if gt (.Values.preStopSleepSeconds | int) 0 }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ .Values.preStopSleepSeconds | int }}
      {{- end }}
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/larder
          readOnly: true
        - name: cache
          mountPath: /var/lib/larder
        - name: tmp
          mountPath: /tmp
        {{- range $i, $u := .Values.upstreams }}
        {{- if $u.credentials }}
        - name: {{ printf "upstream-%d-credentials" $i }}
          mountPath: {{ printf "/run/secrets/larder/%s" (include "larder.upstreamDir" $u.name) }}
          readOnly: true
        {{- end }}
        {{- if and $u.caConfigMap (not $u.caFile) }}
        - name: {{ printf "upstream-%d-ca" $i }}
          mountPath: {{ printf "/run/larder/ca/%s" (include "larder.upstreamDir" $u.name) }}
          readOnly: true
        {{- end }}
        {{- end }}
        {{- if .Values.adminToken.enabled }}
        - name: admin-token
          mountPath: /run/secrets/larder-admin
          readOnly: true
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "larder.fullname" . }}
    - name: tmp
      emptyDir:
        sizeLimit: 64Mi
    {{- if $node }}
    {{- if eq .Values.node.cache.type "hostPath" }}
    - name: cache
      hostPath:
        path: {{ .Values.node.cache.hostPath }}
        type: DirectoryOrCreate
    {{- else if eq .Values.node.cache.type "emptyDir" }}
    - name: cache
      emptyDir:
        {{- with .Values.node.cache.emptyDirSizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- else }}
    {{- fail (printf "node.cache.type must be hostPath or emptyDir, not %q" (toString .Values.node.cache.type)) }}
    {{- end }}
    {{- else if not .Values.persistence.enabled }}
    - name: cache
      emptyDir:
        {{- with .Values.persistence.emptyDirSizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- end }}
    {{- range $i, $u := .Values.upstreams }}
    {{- with $u.credentials }}
    - name: {{ printf "upstream-%d-credentials" $i }}
      secret:
        secretName: {{ .existingSecret }}
        # Group-readable through fsGroup; world-readable without one.
        defaultMode: {{ if $.Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: {{ default "password" .passwordKey }}
            path: {{ default "password" .passwordKey }}
    {{- end }}
    {{- if and $u.caConfigMap (not $u.caFile) }}
    - name: {{ printf "upstream-%d-ca" $i }}
      configMap:
        name: {{ $u.caConfigMap.name }}
        items:
          - key: {{ default "ca.crt" $u.caConfigMap.key }}
            path: {{ default "ca.crt" $u.caConfigMap.key }}
    {{- end }}
    {{- end }}
    {{- if .Values.adminToken.enabled }}
    - name: admin-token
      secret:
        secretName: {{ include "larder.adminTokenSecret" . }}
        # Group-readable through fsGroup; world-readable without one.
        defaultMode: {{ if .Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: {{ .Values.adminToken.key }}
            path: {{ .Values.adminToken.key }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if not $node }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
