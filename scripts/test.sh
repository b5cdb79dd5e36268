#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian/Ubuntu machine that has the
# Rust toolchain, then runs every test of the workspace.
#   - apt: etcd-server (discovery tests start their own etcd), UCX runtime + ucx-utils (kv-transfer over UCX,
#     ucx_perftest baseline), python3-venv.
#   - a Python venv in .venv with the official `openai` client (end-to-end tests drive the router with it),
#     schemathesis (router/tests/fuzz.rs fuzzes a live router from its /openapi.json; under CI=true a
#     missing venv or schemathesis fails that test)
#     and NVIDIA's NVRTC / CUDA header / cuobjdump wheels (kernels compile and are disassembled without a GPU).
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

# The schema-driven HTTP fuzzer, pinned (its checks and generation change between releases).
SCHEMATHESIS_VERSION=4.32.5
CUDA_WHEELS="$PWD/.venv/lib/python3$(python3 -c 'import sys; print(f".{sys.version_info[1]}")')/site-packages/nvidia/cu13"

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
    [[ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("schemathesis"))' 2>/dev/null)" == \
        "$SCHEMATHESIS_VERSION" ]] || .venv/bin/pip install -q "schemathesis==$SCHEMATHESIS_VERSION"
    # NVRTC, the CUDA runtime headers and cuobjdump/nvdisasm from NVIDIA's wheels (no GPU needed): the kernel tests
    # compile every kernel for sm_90a and check its SASS, so a kernel that does not compile fails CI.
    [[ -x "$CUDA_WHEELS/bin/nvdisasm" && -e "$CUDA_WHEELS/lib/libnvrtc.so.13" ]] ||
        .venv/bin/pip install -q nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
            nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
fi
export TANDEM_PYTHON="$PWD/.venv/bin/python"
export LD_LIBRARY_PATH="$CUDA_WHEELS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$CUDA_WHEELS/bin:$PATH"
export TANDEM_CUDA_INCLUDE="${TANDEM_CUDA_INCLUDE:-$CUDA_WHEELS/include}"

cargo test --workspace --all-targets "$@"

# The command images use to fill a kernel cache, checked end to end: NVRTC for sm_90a, then cuobjdump -sass.
cargo run -q --bin tandem -- compile-kernels --arch sm_90a --out "$(mktemp -d)" --check-sass

# Overload (issue 24): open-loop load at twice the measured capacity against `tandem up` for 20 s: every
# request ends with a response or a clean 429/503, the cluster returns to idle and serves again, memory stays
# bounded (scripts/soak.py; `--minutes 10` is the soak in bench/RESULTS.md).
"$TANDEM_PYTHON" scripts/soak.py --seconds 20 --tandem target/debug/tandem

# The GPU projection's arithmetic (bench/gpu/projection.py: tokens/s per GPU at EP-N from measured steps).
"$TANDEM_PYTHON" bench/gpu/projection.py --self-test
# The per-kernel plot of engine-bench --kernel-profile (bench/gpu/kernel_plot.py).
"$TANDEM_PYTHON" bench/gpu/kernel_plot.py --self-test

# The Helm chart and Dockerfile: lint, render, offline schema validation, --check-config on every rendered
# command, and a boot of the CPU/tiny values as local processes (deploy/README.md).
deploy/scripts/check.sh
