#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian/Ubuntu machine that has the
# Rust toolchain, then runs every test of the workspace.
#   - apt: etcd-server (discovery tests start their own etcd), UCX runtime + ucx-utils (kv-transfer over UCX,
#     ucx_perftest baseline), python3-venv.
#   - a Python venv in .venv with the official `openai` client (end-to-end tests drive the router with it).
#   - deploy/scripts/check.sh installs its pinned tools (helm, kubernetes-validate, hadolint) under
#     .cache/deploy-tools.
# Set TANDEM_SKIP_INSTALL=1 to skip the installs (everything already present).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ucx_perftest >/dev/null 2>&1 || need_apt+=(ucx-utils)
ldconfig -p 2>/dev/null | grep -q 'libucp.so.0' || need_apt+=(libucx0)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)

if [[ "${TANDEM_SKIP_INSTALL:-0}" != 1 ]]; then
    if ((${#need_apt[@]})); then
        sudo=""
        [[ $(id -u) -ne 0 ]] && sudo="sudo"
        echo "test.sh: installing ${need_apt[*]}" >&2
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    fi
    if [[ ! -x .venv/bin/python ]]; then
        python3 -m venv .venv
    fi
    .venv/bin/python -c 'import openai' >/dev/null 2>&1 || .venv/bin/pip install -q openai
fi
export TANDEM_PYTHON="$PWD/.venv/bin/python"

cargo test --workspace --all-targets "$@"

# The Helm chart and Dockerfile: lint, render, offline schema validation, --check-config on every rendered
# command, and a boot of the CPU/tiny values as local processes (deploy/README.md).
deploy/scripts/check.sh
