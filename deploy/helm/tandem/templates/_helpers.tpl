{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tandem.clusterName" -}}
{{- default .Release.Name .Values.clusterName -}}
{{- end -}}

{{/* etcd client URLs, comma-separated. */}}
{{- define "tandem.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "http://%s-etcd.%s.svc:%d" (include "tandem.fullname" .) .Release.Namespace (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- if not .Values.etcd.external.endpoints -}}
{{- fail "etcd.enabled is false: give etcd.external.endpoints" -}}
{{- end -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* The model volume: its mount point is the parent of model.path. */}}
{{- define "tandem.modelMountPath" -}}
{{- dir .Values.model.path -}}
{{- end -}}

{{- define "tandem.modelVolume" -}}
- name: model
{{- $src := .Values.model.source }}
{{- if eq $src.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.source.claimName is required with model.source.type pvc" $src.claimName }}
    readOnly: true
{{- else if eq $src.type "hostPath" }}
  hostPath:
    path: {{ required "model.source.hostPath is required with model.source.type hostPath" $src.hostPath }}
    type: Directory
{{- else if eq $src.type "tiny" }}
  emptyDir: {}
{{- else }}
{{- fail (printf "model.source.type %q: expected pvc, hostPath or tiny" $src.type) }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ include "tandem.modelMountPath" . }}
  readOnly: {{ ne .Values.model.source.type "tiny" }}
{{- end -}}

{{/* Init containers that make the model ready: gen-tiny for the tiny source, then `tandem verify`. */}}
{{- define "tandem.modelInitContainers" -}}
{{- $root := .root -}}
{{- if eq $root.Values.model.source.type "tiny" }}
- name: gen-tiny
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["tandem", "gen-tiny", {{ $root.Values.model.path | quote }}]
  securityContext: {{- include "tandem.containerSecurity" (dict "ipcLock" false) | nindent 4 }}
  volumeMounts:
    {{- include "tandem.modelMount" $root | nindent 4 }}
{{- end }}
{{- if and .verify $root.Values.model.verify.enabled }}
- name: verify-model
  image: {{ include "tandem.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - tandem
    - verify
    - {{ $root.Values.model.path | quote }}
    {{- with $root.Values.model.verify.sha256Manifest }}
    - --sha256
    - {{ printf "%s/%s" $root.Values.model.path . | quote }}
    {{- end }}
    {{- if $root.Values.model.verify.tensors }}
    - --tensors
    {{- end }}
  securityContext: {{- include "tandem.containerSecurity" (dict "ipcLock" false) | nindent 4 }}
  volumeMounts:
    {{- include "tandem.modelMount" $root | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "tandem.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
  {{- if .ipcLock }}
  # Registering memory with an RDMA NIC pins it: IPC_LOCK lifts RLIMIT_MEMLOCK for that.
  add: ["IPC_LOCK"]
  {{- end }}
{{- end -}}

{{/* Environment every tandem container gets. */}}
{{- define "tandem.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
{{- if .Values.etcd.auth.user }}
# The etcd password, from its Secret: never a flag, never in the ConfigMap.
- name: TANDEM_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.etcd.auth.passwordSecret.name }}
      key: {{ .Values.etcd.auth.passwordSecret.key }}
{{- end }}
{{- end -}}

{{/* Refuses TLS and etcd credential values that cannot work (rendered once, from the ConfigMap). */}}
{{- define "tandem.checkSecurity" -}}
{{- $t := .Values.tls -}}
{{- if and $t.enabled (not $t.secretName) (not (and $t.routerSecretName $t.workerSecretName)) -}}
{{- fail "tls.enabled needs tls.secretName, or both tls.routerSecretName and tls.workerSecretName" -}}
{{- end -}}
{{- $e := .Values.etcd -}}
{{- if and $e.enabled (or $e.tls.enabled $e.auth.user) -}}
{{- fail "etcd.tls and etcd.auth describe an external etcd (etcd.enabled: false, etcd.external.endpoints): the bundled etcd serves plaintext without authentication" -}}
{{- end -}}
{{- if and $e.tls.enabled (not $e.tls.secretName) -}}
{{- fail "etcd.tls.enabled needs etcd.tls.secretName (a Secret with ca.crt)" -}}
{{- end -}}
{{- if not $e.enabled -}}
{{- range $e.external.endpoints -}}
{{- if and $e.tls.enabled (hasPrefix "http://" .) -}}
{{- fail (printf "etcd.external.endpoints %s: with etcd.tls.enabled, use https://" .) -}}
{{- end -}}
{{- if and (not $e.tls.enabled) (hasPrefix "https://" .) -}}
{{- fail (printf "etcd.external.endpoints %s: https:// needs etcd.tls.enabled and etcd.tls.secretName" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $e.auth.user (not $e.auth.passwordSecret.name) -}}
{{- fail "etcd.auth.user needs etcd.auth.passwordSecret.name (the password comes from a Secret, never from values)" -}}
{{- end -}}
{{- end -}}

{{/* The Secret volumes of the TLS options: (dict "root" $ "side" "router"|"worker"). */}}
{{- define "tandem.securityVolumes" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled }}
- name: cluster-tls
  secret:
    secretName: {{ ternary (default $t.secretName $t.routerSecretName) (default $t.secretName $t.workerSecretName) (eq .side "router") }}
    # 0440: the key is readable by the pod's user and group only.
    defaultMode: 288
{{- end }}
{{- with .root.Values.etcd.tls }}
{{- if .enabled }}
- name: etcd-tls
  secret:
    secretName: {{ .secretName }}
    defaultMode: 288
{{- end }}
{{- end }}
{{- end -}}

{{/* Where those Secrets are mounted (the paths the ConfigMap's TANDEM_TLS_* and TANDEM_ETCD_* name). */}}
{{- define "tandem.securityMounts" -}}
{{- if .Values.tls.enabled }}
- name: cluster-tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: {{ .Values.etcd.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* One pool in NOTES.txt: (dict "root" $ "role" "prefill"|"decode"). */}}
{{- define "tandem.notesPool" -}}
{{- $p := index .root.Values .role -}}
{{- if gt (int $p.ep) 1 -}}
{{ $p.replicas }} {{ .role }} group(s) of {{ $p.ep }} expert-parallel ranks (LeaderWorkerSet, one pod and {{ $p.gpus }} GPU(s) per rank)
{{- else -}}
{{ $p.replicas }} {{ .role }} worker(s)
{{- end -}}
{{- end -}}
