#!/usr/bin/env bash
# A/B of engine-bench on the GPU: a base commit's binary against this tree's, alternating, on one machine.
#
#   bench/gpu/engine-ab.sh pack BASE   (here) builds BASE's engine-bench in a worktree, into
#                                      gpu-carry/ab/engine-bench-base.xz (run `scripts/gpu-test.sh pack` too)
#   bench/gpu/engine-ab.sh run [ROUNDS] (on the device, carry ["gpu-carry"]) runs both, fp8 and full, ROUNDS
#                                      times (default 2), JSON into $OUT (or bench/out/), one line per run
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
pack)
    base=${2:?base commit}
    wt=$(mktemp -d /tmp/tandem-ab.XXXX)
    git worktree add -f "$wt" "$base" -q
    (cd "$wt" && CARGO_TARGET_DIR="$wt-target" cargo build --release -q -p engine --bin engine-bench)
    mkdir -p gpu-carry/ab
    strip -o gpu-carry/ab/engine-bench-base "$wt-target/release/engine-bench"
    xz -f -T2 gpu-carry/ab/engine-bench-base
    git worktree remove --force "$wt"
    echo "gpu-carry/ab/engine-bench-base.xz from $(git rev-parse --short "$base")"
    ;;
run)
    rounds=${2:-2}
    out=${OUT:-bench/out}
    mkdir -p /tmp/tandem-gpu "$out"
    for f in gpu-carry/*.xz gpu-carry/ab/*.xz; do
        xz -dc "$f" >"/tmp/tandem-gpu/$(basename "$f" .xz)"
        chmod +x "/tmp/tandem-gpu/$(basename "$f" .xz)"
    done
    export PATH="/tmp/tandem-gpu:/usr/local/cuda/bin:$PATH"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export TANDEM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
    for round in $(seq "$rounds"); do
        for b in engine-bench-base engine-bench; do
            for prec in fp8 full; do
                TANDEM_KERNEL_CACHE="/tmp/tandem-gpu/kernels-$b" "$b" --device cuda --precision "$prec" --json \
                    --out "$out/$b-$prec-$round.json" >"/tmp/tandem-gpu/$b-$prec-$round.log" 2>&1
                echo "$round $b $prec: $(grep -o '"bench":"[a-z_0-9]*"\|"tokens_per_s":[0-9]*' \
                    "/tmp/tandem-gpu/$b-$prec-$round.log" | paste -sd' ' | sed 's/"bench"://g; s/"tokens_per_s"://g')"
            done
        done
    done
    ;;
*)
    sed -n '2,9p' "$0"
    exit 2
    ;;
esac
