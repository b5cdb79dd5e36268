#!/usr/bin/env bash
# kv-transfer bench on a host without Rust or UCX: runs the kv-bench binary, Debian's UCX 1.13.1 libraries
# and ucx_perftest carried in $KVP (default .kvperf: kv-bench, ucx_perftest, lib/*.so.0, lib/ucx/libuct_cma.so.0).
#   bench/kv-transfer/run-host.sh OUTDIR [phase]
# phase "sweep" (default): tokio TCP and UCX over tcp at the default lane count, full size sweep with
# ucx_perftest baselines; "sweep2": UCX over shared memory, the put data paths, single-lane references
# (each phase fits the device tool's 10-minute call). Phase "lanes": 8K and 128K at 1, 4 and 8 lanes.
set -u
OUTDIR=${1:?outdir}
PHASE=${2:-sweep}
KVP=${KVP:-.kvperf}
KVP=$(cd "$KVP" && pwd)
export LD_LIBRARY_PATH=$KVP/lib PATH=$KVP:$PATH UCX_MODULE_DIR=$KVP/lib/ucx
mkdir -p "$OUTDIR"
echo "host: $(nproc) cores, $(uptime)" | tee -a "$OUTDIR/log.txt"
ucx_perftest -h >/dev/null 2>&1 || echo "ucx_perftest does not run" | tee -a "$OUTDIR/log.txt"

run() { # label, then env assignments and kv-bench arguments
    local label=$1
    shift
    echo "== $label $(date +%T)" | tee -a "$OUTDIR/log.txt"
    # stderr through a pipe (kv-bench's UCX_LOG_FILE=stderr would be safe on a file too; older kv-bench
    # builds used /dev/stderr, which UCX opens with truncation).
    env "$@" 2> >(sed "s/^/$label /" >>"$OUTDIR/log.txt") | sed "s/^/$label /" | tee -a "$OUTDIR/results.txt"
}

case "$PHASE" in
sweep) # tcp-carried transports (each up to ~4 min: UCX's emulated 1 GiB put baseline may hit its 30 s cap)
    B="kv-bench --layers 62 --reps 5 --json"
    run tcp timeout 280 $B --transport tcp
    run ucx-tcp-auto UCX_TLS=tcp timeout 280 $B --transport ucx
    ;;
sweep2) # shared memory, the emulated-put comparison over tcp, and single-lane references
    B="kv-bench --layers 62 --reps 5 --json"
    run ucx-sm-auto UCX_TLS=sm,self timeout 150 $B --transport ucx
    run ucx-sm-put UCX_TLS=sm,self TANDEM_UCX_ONE_SIDED_PUTS=1 TANDEM_UCX_DATA_PATH=put timeout 150 $B --transport ucx --tokens 8192,131072
    run ucx-tcp-put UCX_TLS=tcp TANDEM_UCX_ONE_SIDED_PUTS=1 TANDEM_UCX_DATA_PATH=put timeout 150 $B --transport ucx --tokens 8192,131072 --no-baselines
    run tcp-l1 TANDEM_KV_LANES=1 timeout 60 $B --transport tcp --tokens 8192 --no-perftest --no-baselines
    run ucx-tcp-auto-l1 TANDEM_KV_LANES=1 UCX_TLS=tcp timeout 60 $B --transport ucx --tokens 8192 --no-perftest --no-baselines
    run ucx-sm-auto-l1 TANDEM_KV_LANES=1 UCX_TLS=sm,self timeout 60 $B --transport ucx --tokens 8192 --no-perftest --no-baselines
    ;;
lanes)
    B="kv-bench --layers 62 --reps 3 --budget-s 4 --json --no-perftest --tokens 8192,131072"
    for l in 1 4 8; do
        run "tcp-l$l" TANDEM_KV_LANES=$l timeout 60 $B --transport tcp
        run "ucx-tcp-am-l$l" TANDEM_KV_LANES=$l UCX_TLS=tcp timeout 60 $B --transport ucx
        run "ucx-sm-put-l$l" TANDEM_KV_LANES=$l UCX_TLS=sm,self TANDEM_UCX_ONE_SIDED_PUTS=1 TANDEM_UCX_DATA_PATH=put timeout 60 $B --transport ucx
        run "ucx-sm-am-l$l" TANDEM_KV_LANES=$l UCX_TLS=sm,self TANDEM_UCX_DATA_PATH=am timeout 60 $B --transport ucx
    done
    ;;
esac
grep -h overhead_us "$OUTDIR/log.txt" >"$OUTDIR/overhead.txt" || true
echo "done $(date +%T)" | tee -a "$OUTDIR/log.txt"
