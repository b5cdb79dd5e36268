{{/*
One worker pool's pod template: (dict "root" $ "role" "prefill"|"decode").
The same spec serves a StatefulSet pod, or every rank of a LeaderWorkerSet's expert-parallel groups.
*/}}
{{- define "tandem.workerPodSpec" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $p := index $root.Values $role -}}
{{- $full := include "tandem.fullname" $root -}}
{{- if le (int $p.terminationGracePeriodSeconds) (int $p.drainTimeoutSeconds) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed %s.drainTimeoutSeconds (%v): Kubernetes would kill the worker mid-drain" $role $p.terminationGracePeriodSeconds $role $p.drainTimeoutSeconds) -}}
{{- end -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $p.terminationGracePeriodSeconds }}
hostIPC: {{ $p.hostIPC }}
{{- with $p.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if or $p.affinity (ne $p.antiAffinity "none") }}
affinity:
  {{- with $p.affinity }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- if and (ne $p.antiAffinity "none") (not (hasKey $p.affinity "podAntiAffinity")) }}
  podAntiAffinity:
    {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (fromYaml (include "tandem.selectorLabels" (dict "root" $root "component" $role)))) }}
    {{- if eq $p.antiAffinity "hard" }}
    requiredDuringSchedulingIgnoredDuringExecution:
      {{- list $term | toYaml | nindent 6 }}
    {{- else }}
    preferredDuringSchedulingIgnoredDuringExecution:
      {{- list (dict "weight" 100 "podAffinityTerm" $term) | toYaml | nindent 6 }}
    {{- end }}
  {{- end }}
{{- end }}
{{- with include "tandem.modelInitContainers" (dict "root" $root "verify" true) | trim }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
containers:
  - name: {{ $role }}-worker
    image: {{ include "tandem.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command:
      - tandem
      - {{ $role }}-worker
      - --listen
      - {{ printf "0.0.0.0:%d" (int $p.ports.grpc) | quote }}
      - --advertise
      - {{ printf "$(POD_IP):%d" (int $p.ports.grpc) | quote }}
      - --worker-id
      - "$(POD_NAME)"
      - --metrics-listen
      - {{ printf "0.0.0.0:%d" (int $p.ports.metrics) | quote }}
      - --kv-transport
      - {{ $p.kvTransport | quote }}
      {{- with $p.ucxTls }}
      - --ucx-tls
      - {{ . | quote }}
      {{- end }}
      {{- if eq $role "decode" }}
      - --kv-listen
      - {{ printf "0.0.0.0:%d" (int $p.ports.kv) | quote }}
      - --kv-advertise-host
      - "$(POD_IP)"
      {{- end }}
      {{- with $p.kvBlocks }}
      - --kv-blocks
      - {{ . | quote }}
      {{- end }}
      - --max-num-seqs
      - {{ $p.maxNumSeqs | quote }}
      - --max-num-batched-tokens
      - {{ $p.maxNumBatchedTokens | quote }}
      - --drain-timeout-s
      - {{ $p.drainTimeoutSeconds | quote }}
      {{- with $p.device }}
      - --device
      - {{ . | quote }}
      {{- end }}
      {{- if gt (int $p.ep) 1 }}
      {{- with $p.epStepTimeoutSecs }}
      - --ep-step-timeout-secs
      - {{ . | quote }}
      {{- end }}
      {{- with $p.epStartTimeoutSecs }}
      - --ep-start-timeout-secs
      - {{ . | quote }}
      {{- end }}
      {{- end }}
      {{- if eq $role "prefill" }}
      {{- if not $p.prefixCaching }}
      - --no-prefix-caching
      {{- end }}
      {{- else }}
      - --transfer-timeout-ms
      - {{ $p.transferTimeoutMs | quote }}
      - --growth-watermark-blocks
      - {{ $p.growthWatermarkBlocks | quote }}
      {{- if not $p.mtp }}
      - --no-mtp
      {{- end }}
      {{- if $p.verifyChecksum }}
      - --verify-checksum
      {{- end }}
      {{- end }}
      {{- range $p.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    envFrom:
      - configMapRef:
          name: {{ $full }}
    env:
      {{- include "tandem.commonEnv" $root | nindent 6 }}
      {{- if $root.Values.kernelCache.enabled }}
      # Compiled kernels go to the kernel-cache volume (the image's own cache, compiled at build time, is
      # used when the volume is off).
      - name: TANDEM_KERNEL_CACHE
        value: {{ printf "%s/kernels" $root.Values.kernelCache.mountPath | quote }}
      {{- end }}
      {{- if gt (int $p.ep) 1 }}
      {{- $lws := printf "%s-%s" $full $role }}
      # Expert parallelism (--ep RANK/WORLD@HOST:PORT): the rank and group from the LeaderWorkerSet's pod
      # labels (the leader, pod <lws>-G, is worker 0), the leader's stable DNS name under the LWS's headless
      # Service. The kubelet expands $(VAR) from variables defined above, so this order matters.
      - name: TANDEM_EP_RANK
        valueFrom:
          fieldRef:
            fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
      - name: TANDEM_EP_GROUP
        valueFrom:
          fieldRef:
            fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
      - name: TANDEM_EP
        value: {{ printf "$(TANDEM_EP_RANK)/%d@%s-$(TANDEM_EP_GROUP).%s.%s.svc.%s:%d" (int $p.ep) $lws $lws $root.Release.Namespace $root.Values.clusterDomain (int $p.ports.ep) | quote }}
      {{- end }}
      {{- with $p.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - name: grpc
        containerPort: {{ $p.ports.grpc }}
      {{- if eq $role "decode" }}
      - name: kv
        containerPort: {{ $p.ports.kv }}
      {{- end }}
      - name: metrics
        containerPort: {{ $p.ports.metrics }}
      {{- if gt (int $p.ep) 1 }}
      # The group's rendezvous: rank 0 listens, the other ranks connect (NCCL then opens its own ports).
      - name: ep
        containerPort: {{ $p.ports.ep }}
      {{- end }}
    # The gRPC port opens once the model is loaded (and kernels compiled); readiness is grpc.health.v1,
    # which turns NOT_SERVING when the worker drains. Kubelet gRPC probes cannot speak TLS: with tls on,
    # startup is a TCP check of the port and readiness the metrics port's /ready (503 while draining).
    startupProbe:
      {{- if $root.Values.tls.enabled }}
      tcpSocket:
        port: {{ $p.ports.grpc }}
      {{- else }}
      grpc:
        port: {{ $p.ports.grpc }}
      {{- end }}
      periodSeconds: {{ $p.startupProbe.periodSeconds }}
      failureThreshold: {{ $p.startupProbe.failureThreshold }}
    readinessProbe:
      {{- if $root.Values.tls.enabled }}
      httpGet:
        path: /ready
        port: metrics
      {{- else }}
      grpc:
        port: {{ $p.ports.grpc }}
      {{- end }}
      periodSeconds: 5
      failureThreshold: 2
    livenessProbe:
      httpGet:
        path: /health
        port: metrics
      periodSeconds: 10
      failureThreshold: 6
    resources:
      {{- $res := deepCopy (default dict $p.resources) }}
      {{- $limits := default dict $res.limits }}
      {{- $requests := default dict $res.requests }}
      {{- if gt (int $p.gpus) 0 }}
      {{- $_ := set $limits "nvidia.com/gpu" (int $p.gpus) }}
      {{- $_ := set $requests "nvidia.com/gpu" (int $p.gpus) }}
      {{- end }}
      {{- if $p.rdma.enabled }}
      {{- $_ := set $limits $p.rdma.resourceName (int $p.rdma.count) }}
      {{- $_ := set $requests $p.rdma.resourceName (int $p.rdma.count) }}
      {{- end }}
      {{- with $requests }}
      requests: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $limits }}
      limits: {{- toYaml . | nindent 8 }}
      {{- end }}
    securityContext: {{- include "tandem.containerSecurity" (dict "ipcLock" $p.rdma.enabled) | nindent 6 }}
    volumeMounts:
      {{- include "tandem.modelMount" $root | nindent 6 }}
      - name: dshm
        mountPath: /dev/shm
      {{- if $root.Values.kernelCache.enabled }}
      - name: kernel-cache
        mountPath: {{ $root.Values.kernelCache.mountPath }}
      {{- end }}
      {{- with include "tandem.securityMounts" $root | trim }}
      {{- . | nindent 6 }}
      {{- end }}
volumes:
  {{- include "tandem.modelVolume" $root | nindent 2 }}
  {{- with include "tandem.securityVolumes" (dict "root" $root "side" "worker") | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $p.shmSize }}
  {{- if $root.Values.kernelCache.enabled }}
  {{- $kc := $root.Values.kernelCache }}
  - name: kernel-cache
    {{- if eq $kc.type "hostPath" }}
    hostPath:
      path: {{ $kc.hostPath }}
      type: DirectoryOrCreate
    {{- else if eq $kc.type "pvc" }}
    persistentVolumeClaim:
      claimName: {{ required "kernelCache.claimName is required with kernelCache.type pvc" $kc.claimName }}
    {{- else }}
    emptyDir:
      sizeLimit: {{ $kc.sizeLimit }}
    {{- end }}
  {{- end }}
{{- end -}}
