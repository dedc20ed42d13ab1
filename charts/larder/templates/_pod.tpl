{{/*
The larder pod template, shared by the StatefulSet (deployment mode) and
the DaemonSet (node mode).
*/}}
{{- define "larder.podTemplate" -}}
{{- $node := include "larder.nodeMode" . -}}
{{- $runtimeConfig := include "larder.runtimeConfig" . -}}
{{- $nodeSetup := and $node .Values.nodeSetup.enabled -}}
{{- $loopbackAdmin := and $node .Values.node.hostNetwork (not .Values.node.adminOnHostIP) -}}
metadata:
  labels:
    {{- include "larder.labels" (dict "root" . "component" "mirror") | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Restart pods when larder.toml changes (larder reads it at start).
    # Secrets (upstream passwords, TLS certificate, htpasswd) are re-read
    # by larder when they change: no restart needed for those.
    checksum/config: {{ include "larder.config" . | sha256sum }}
    {{- if $nodeSetup }}
    checksum/node-setup-script: {{ .Files.Get "files/containerd-hosts.sh" | sha256sum }}
    {{- end }}
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
  {{- if or (and $node (eq .Values.node.cache.type "hostPath") .Values.node.cache.fixPermissions) $runtimeConfig $nodeSetup }}
  initContainers:
    {{- if and $node (eq .Values.node.cache.type "hostPath") .Values.node.cache.fixPermissions }}
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
        {{- with .Values.nodeSetup.seLinuxOptions }}
        seLinuxOptions:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      resources:
        {{- toYaml .Values.nodeSetup.resources | nindent 8 }}
      volumeMounts:
        - name: cache
          mountPath: /var/lib/larder
    {{- end }}
    {{- if $runtimeConfig }}
    # On the host network larder listens on the node's own IP only (not on
    # every address of the node): known here, written into larder.toml.
    - name: listen-address
      image: {{ include "larder.nodeSetup.image" . }}
      imagePullPolicy: {{ .Values.nodeSetup.image.pullPolicy }}
      command:
        - /bin/sh
        - -c
        - |
          set -eu
          ip="${HOST_IP:?no HOST_IP}"
          case "$ip" in *:*) ip="[$ip]" ;; esac
          sed -e "s|^listen = .*|listen = \"$ip:{{ include "larder.registryPort" . }}\"|" \
          {{- if .Values.node.adminOnHostIP }}
            -e "s|^admin_listen = .*|admin_listen = \"$ip:{{ .Values.ports.admin }}\"|" \
          {{- end }}
            /etc/larder/larder.toml >/run/larder/config/larder.toml
          grep -E '^(listen|admin_listen) ' /run/larder/config/larder.toml
      env:
        - name: HOST_IP
          valueFrom:
            fieldRef:
              fieldPath: status.hostIP
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml .Values.nodeSetup.resources | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/larder
          readOnly: true
        - name: runtime-config
          mountPath: /run/larder/config
    {{- end }}
    {{- if $nodeSetup }}
    # Points this node's containerd at this larder (hosts.toml), after
    # checking that containerd reads those files; fails loudly otherwise.
    {{- include "larder.nodeSetup.container" (dict "root" . "name" "containerd-hosts" "mode" "setup") | trim | nindent 4 }}
    {{- end }}
  {{- end }}
  containers:
    - name: larder
      image: {{ include "larder.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - --config
        - {{ if $runtimeConfig }}/run/larder/config/larder.toml{{ else }}/etc/larder/larder.toml{{ end }}
        - --log-format
        - {{ .Values.logFormat }}
      env:
        - name: RUST_LOG
          value: {{ .Values.logLevel | quote }}
        {{- if .Values.cluster.enabled }}
        # `[cluster] self` is http(s)://${POD_IP}:<peer port>.
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: registry
          containerPort: {{ include "larder.registryPort" . }}
          {{- if $node }}
          hostPort: {{ .Values.node.hostPort }}
          {{- if and .Values.node.hostIP (not .Values.node.hostNetwork) }}
          hostIP: {{ .Values.node.hostIP }}
          {{- end }}
          {{- end }}
          protocol: TCP
        - name: admin
          containerPort: {{ .Values.ports.admin }}
          protocol: TCP
        {{- if .Values.cluster.enabled }}
        # The peer listener: in the peers' headless Service only.
        - name: peer
          containerPort: {{ .Values.cluster.port }}
          protocol: TCP
        {{- end }}
      {{- range $probe := list "startupProbe" "livenessProbe" "readinessProbe" }}
      {{ $probe }}:
        httpGet:
          path: {{ if eq $probe "readinessProbe" }}/readyz{{ else }}/healthz{{ end }}
          port: admin
          {{- if include "larder.adminTLS" $ }}
          # The admin port speaks TLS (config.tls); the kubelet does not verify probe certificates.
          scheme: HTTPS
          {{- end }}
          {{- if $loopbackAdmin }}
          # The admin port listens on the node's loopback only.
          host: 127.0.0.1
          {{- end }}
        {{- toYaml (get $.Values $probe) | nindent 8 }}
      {{- end }}
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
        {{- if $runtimeConfig }}
        - name: runtime-config
          mountPath: /run/larder/config
          readOnly: true
        {{- end }}
        - name: cache
          mountPath: /var/lib/larder
        - name: tmp
          mountPath: /tmp
        {{- if .Values.config.tls.enabled }}
        - name: tls
          mountPath: /run/larder/tls
          readOnly: true
        {{- end }}
        {{- if .Values.config.auth.enabled }}
        - name: auth
          mountPath: /run/larder/auth
          readOnly: true
        {{- end }}
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
        {{- if .Values.cluster.enabled }}
        - name: cluster-secret
          mountPath: {{ dir (include "larder.clusterSecretPath" .) }}
          readOnly: true
        {{- end }}
        {{- if and .Values.shared.enabled .Values.shared.credentials.existingSecret }}
        - name: shared-credentials
          mountPath: {{ include "larder.sharedCredentialsDir" . }}
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
    {{- if $runtimeConfig }}
    - name: runtime-config
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
    {{- end }}
    {{- if $node }}
    {{- if eq .Values.node.cache.type "hostPath" }}
    - name: cache
      hostPath:
        path: {{ .Values.node.cache.hostPath }}
        type: DirectoryOrCreate
    {{- else if eq .Values.node.cache.type "emptyDir" }}
    # Counted by the kubelet as this pod's ephemeral storage: past the
    # sizeLimit (or under DiskPressure) it evicts larder, not its neighbours.
    - name: cache
      emptyDir:
        sizeLimit: {{ required "node.cache.emptyDirSizeLimit is required with node.cache.type=emptyDir: the kubelet then evicts larder, not other pods, when the cache outgrows it" .Values.node.cache.emptyDirSizeLimit }}
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
    {{- if .Values.config.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ .Values.config.tls.existingSecret }}
        defaultMode: {{ if $.Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: tls.crt
            path: tls.crt
          - key: tls.key
            path: tls.key
          {{- if and (include "larder.peerTLS" .) .Values.config.tls.caKey }}
          # `[cluster] ca_file`: peers are verified with this CA.
          - key: {{ .Values.config.tls.caKey }}
            path: ca.crt
          {{- end }}
    {{- end }}
    {{- if .Values.config.auth.enabled }}
    - name: auth
      secret:
        secretName: {{ .Values.config.auth.existingSecret }}
        defaultMode: {{ if $.Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: {{ .Values.config.auth.htpasswdKey }}
            path: htpasswd
    {{- end }}
    {{- if $nodeSetup }}
    {{- include "larder.nodeSetup.volumes" (dict "root" .) | trim | nindent 4 }}
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
    {{- if .Values.cluster.enabled }}
    - name: cluster-secret
      secret:
        secretName: {{ include "larder.clusterSecret" . }}
        # Group-readable through fsGroup; world-readable without one.
        defaultMode: {{ if .Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: {{ .Values.cluster.secretKey }}
            path: {{ .Values.cluster.secretKey }}
    {{- end }}
    {{- with .Values.shared }}
    {{- if and .enabled .credentials.existingSecret }}
    - name: shared-credentials
      secret:
        secretName: {{ .credentials.existingSecret }}
        defaultMode: {{ if $.Values.podSecurityContext.fsGroup }}0440{{ else }}0444{{ end }}
        items:
          - key: {{ .credentials.accessKeyIdKey }}
            path: {{ .credentials.accessKeyIdKey }}
          - key: {{ .credentials.secretAccessKeyKey }}
            path: {{ .credentials.secretAccessKeyKey }}
    {{- end }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (ternary .Values.node.affinity .Values.affinity (not (not $node))) }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if not $node }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with (ternary .Values.node.tolerations .Values.tolerations (not (not $node))) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
