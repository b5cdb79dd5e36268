#!/usr/bin/env bash
# GPU tests on a machine without Rust, in two halves.
#
#   scripts/gpu-test.sh pack          (here, with the Rust toolchain)
#       Builds `tandem` and the engine's test binary (release), strips and compresses them into gpu-carry/
#       (ignored by git) with a manifest, prints the size of everything a device call carries, refuses a
#       bundle over the 64 MiB carry limit, and prints the device command.
#   scripts/gpu-test.sh run PHASE     (on the GPU machine, from the repository root)
#       Unpacks gpu-carry/, sets the environment (CUDA libraries, TANDEM_REQUIRE_GPU=1 so a GPU test that
#       finds no GPU fails, NVLink multicast off), runs PHASE and writes a summary (commit, device, driver,
#       every test by name with pass/fail, skipped count) to $OUT (or bench/out/), exiting non-zero on
#       any failure. PHASE:
#         kernels   the GPU tests of the engine (test names containing `cuda::`)
#         sass      `tandem compile-kernels --check-sass`: NVRTC on the device, cuobjdump on every CUBIN
#         loop      scripts/kernel-loop.py: every kernel through CuPy's NVRTC against a NumPy reference
#         sanitize  the GPU tests under compute-sanitizer memcheck and racecheck
#         all       kernels, sass, loop, sanitize
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-carry
LIMIT=$((64 * 1024 * 1024))

pack() {
    command -v xz >/dev/null || { echo "gpu-test.sh: xz is needed to compress the bundle" >&2; exit 1; }
    cargo build --release --bin tandem
    local tests
    tests=$(cargo test --release -p engine --lib --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "engine" and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1)
    [[ -x "$tests" ]] || { echo "gpu-test.sh: engine test binary not found" >&2; exit 1; }
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
    local name src
    for pair in "tandem:target/release/tandem" "engine-tests:$tests"; do
        name=${pair%%:*}
        src=${pair#*:}
        strip -o "$BUNDLE/$name" "$src"
        xz -T0 -6 "$BUNDLE/$name"
    done
    {
        echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!gpu-carry' || echo '+dirty')"
        echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
        (cd "$BUNDLE" && sha256sum ./*.xz)
    } >"$BUNDLE/MANIFEST"
    local tree bundle total
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
    bundle=$(du -cb "$BUNDLE" | tail -n 1 | cut -f1)
    total=$((tree + bundle))
    echo "bundle:"
    (cd "$BUNDLE" && ls -l | awk 'NR>1 {printf "  %-20s %6.1f MiB\n", $9, $5/1048576}')
    awk -v t="$tree" -v b="$bundle" 'BEGIN { printf "working tree %.1f MiB + bundle %.1f MiB = %.1f MiB (carry limit 64 MiB)\n", t/1048576, b/1048576, (t+b)/1048576 }'
    if ((total > LIMIT)); then
        echo "gpu-test.sh: the bundle and the working tree exceed the carry limit" >&2
        exit 1
    fi
    echo
    echo "device command (carry [\"$BUNDLE\"]):  bash scripts/gpu-test.sh run all"
}

unpack() {
    mkdir -p /tmp/tandem-gpu
    for f in "$BUNDLE"/*.xz; do
        xz -dc "$f" >"/tmp/tandem-gpu/$(basename "$f" .xz)"
        chmod +x "/tmp/tandem-gpu/$(basename "$f" .xz)"
    done
    export PATH="/tmp/tandem-gpu:/usr/local/cuda/bin:$PATH"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export TANDEM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export TANDEM_KERNEL_CACHE=/tmp/tandem-gpu/kernels
}

# Runs the engine's GPU tests (optionally under a wrapper), appending "name | result" rows to $SUMMARY.
run_tests() {
    local label=$1
    shift
    local log="$OUTDIR/$label.log" rc=0
    "$@" /tmp/tandem-gpu/engine-tests cuda:: --test-threads=1 >"$log" 2>&1 || rc=$?
    grep -E '^test .* \.\.\. ' "$log" | sed -E 's/^test (.*) \.\.\. (.*)$/| '"$label"' | \1 | \2 |/' >>"$SUMMARY" || true
    local skipped
    skipped=$(grep -c '^skipped:' "$log" || true)
    echo "| $label | (skipped messages) | $skipped |" >>"$SUMMARY"
    if ((rc != 0)) || grep -q 'ERROR SUMMARY: [1-9]' "$log"; then
        FAILED+=("$label")
        tail -n 30 "$log"
    fi
}

phase_kernels() { run_tests kernels; }

phase_sanitize() {
    run_tests memcheck compute-sanitizer --tool memcheck --error-exitcode 1
    run_tests racecheck compute-sanitizer --tool racecheck --error-exitcode 1
}

phase_sass() {
    local rc=0
    tandem compile-kernels --arch sm_90a --check-sass >"$OUTDIR/sass.log" 2>&1 || rc=$?
    cat "$OUTDIR/sass.log"
    echo "| sass | tandem compile-kernels --check-sass | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(sass)
}

phase_loop() {
    local rc=0
    python3 scripts/kernel-loop.py all --json "$OUTDIR/kernel-loop.json" >"$OUTDIR/loop.log" 2>&1 || rc=$?
    cat "$OUTDIR/loop.log"
    echo "| loop | scripts/kernel-loop.py all | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(loop)
}

run() {
    local phase=${1:?usage: gpu-test.sh run kernels|sass|loop|sanitize|all}
    [[ -d "$BUNDLE" ]] || { echo "gpu-test.sh: $BUNDLE/ is missing: run 'scripts/gpu-test.sh pack' here and carry it" >&2; exit 1; }
    unpack
    OUTDIR=${OUT:-bench/out}
    mkdir -p "$OUTDIR"
    SUMMARY="$OUTDIR/gpu-summary-$phase.md"
    FAILED=()
    {
        echo "# GPU test summary: $phase"
        echo
        echo "- $(head -n 1 "$BUNDLE/MANIFEST")"
        echo "- date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "- device $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
        echo "- CUDA $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo '?')"
        echo
        echo "| phase | test | result |"
        echo "|---|---|---|"
    } >"$SUMMARY"
    case $phase in
        kernels) phase_kernels ;;
        sass) phase_sass ;;
        loop) phase_loop ;;
        sanitize) phase_sanitize ;;
        all) phase_sass; phase_kernels; phase_loop; phase_sanitize ;;
        *) echo "gpu-test.sh: unknown phase $phase" >&2; exit 2 ;;
    esac
    local passed failed
    passed=$(grep -c '| ok |$' "$SUMMARY" || true)
    failed=$(grep -cE '\| FAILED \|$' "$SUMMARY" || true)
    {
        echo
        echo "$passed passed, $failed failed"
        ((${#FAILED[@]} == 0)) || echo "failed phases: ${FAILED[*]}"
    } >>"$SUMMARY"
    cat "$SUMMARY"
    ((${#FAILED[@]} == 0))
}

case ${1:-} in
    pack) pack ;;
    run) shift; run "$@" ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
