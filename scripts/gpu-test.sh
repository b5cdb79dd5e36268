#!/usr/bin/env bash
# GPU tests on a machine without Rust, in two halves.
#
#   scripts/gpu-test.sh pack          (here, with the Rust toolchain)
#       Builds `tandem`, engine-bench, the engine's test binaries and kv-transfer's kv-bench, kv-peer and GPU
#       transfer test (release, `--features cuda`), strips and compresses them into gpu-carry/ (ignored by git)
#       with a trimmed CUDA-capable UCX (the libucx-cu13 wheel, downloaded once into .whl/) and a manifest, prints the size of everything a device call carries, refuses a
#       bundle over the 64 MiB carry limit, and prints the device command.
#   scripts/gpu-test.sh run PHASE     (on the GPU machine, from the repository root)
#       Unpacks gpu-carry/, sets the environment (CUDA libraries, TANDEM_REQUIRE_GPU=1 so a GPU test that
#       finds no GPU fails, NVLink multicast off), runs PHASE and writes a summary (commit, device, driver,
#       every test by name with pass/fail, skipped count) to $OUT (or bench/out/), exiting non-zero on
#       any failure. PHASE:
#         kernels   the GPU tests of the engine (test names containing `cuda::`)
#         model     the CUDA backend: the engine's model and golden tests on the GPU (TANDEM_TEST_DEVICE=cuda)
#                   and engine/tests/gpu.rs (GPU against CPU), then `tandem generate --device cuda`
#         sass      `tandem compile-kernels --check-sass`: NVRTC on the device, cuobjdump on every CUBIN
#         loop      scripts/kernel-loop.py: every kernel through CuPy's NVRTC against a NumPy reference
#         sanitize  the GPU tests under compute-sanitizer memcheck and racecheck
#         bench     engine-bench on the GPU (tiny model, both precisions, JSON) and an Nsight Compute
#                   per-kernel time breakdown of a decode step
#         v32       engine-bench --kernel-profile on the GPU with the synthetic DeepSeek-V3.2-dimension model (engine::synthetic;
#                   V32_MODEL, default synthetic:v32,experts=32: 61 layers, one rank of EP-8), prefill 512 and
#                   2048 tokens, speculative decode at batch 1, 16, 64 over a 2048-token context (V32_ARGS to change),
#                   with the grouped experts (V32_GROUPED="1 0" adds the per-pair kernel, TANDEM_MOE_GROUPED=0); then
#                   bench/gpu/projection.py and bench/gpu/kernel_plot.py (time per kernel per step, SVG)
#         indexer   bench/gpu/indexer_bench.py: the indexer's scorer + top-k, decode and prefill shapes, next to
#                   the same-run copy bandwidth and a naive PyTorch version (INDEXER_BENCH_ARGS=--quick: fewer)
#         gemm      bench/gpu/gemm_bench.py: checks and benchmark of the FP8 block-scaled GEMM on every DeepSeek-V3.2
#                   linear shape, M = 1..8192, next to cuBLASLt (torch._scaled_mm) and the copy bandwidth
#                   (GEMM_BENCH_ARGS=--quick: fewer)
#         bf16      bench/gpu/bf16_bench.py: the bf16-weight products on the tensor cores (lm_head, eh_proj, the
#                   absorbed MLA projections over 128 heads, 1..4096 rows) next to the CUDA-core kernels they
#                   replace, cuBLAS bf16 and the copy bandwidth (BF16_BENCH_ARGS=--quick: fewer)
#         f32       bench/gpu/f32_bench.py: the f32 linears (router gate, weights_proj) through the tiled kernel next to
#                   the row kernel with the same bits
#         moe       bench/gpu/moe_bench.py: the routed experts' grouped FP8 GEMM (DeepSeek-V3.2's expert shapes, 8 and 32
#                   local experts, 1..1024 tokens each) next to the copy bandwidth and the plain product of one
#                   expert (MOE_BENCH_ARGS=--quick: fewer)
#         sparse-mla bench/gpu/sparse_mla_bench.py: checks and benchmark of the sparse MLA decode kernel next to the
#                   same-run copy bandwidth, bf16 matmul rate, a naive PyTorch version and FlashMLA: with
#                   FLASHMLA_SRC (a FlashMLA tree with CUTLASS, ENV-NOTES) it is built there first unless built
#                   (SPARSE_MLA_BENCH_ARGS=--quick: fewer shapes)
#         sparse-prefill bench/gpu/sparse_prefill_bench.py: the sparse MLA prefill forms (staged, gathering) over
#                   4096-token chunks at 8K..128K contexts next to FlashMLA's sparse prefill (built as for
#                   sparse-mla), and dense causal prompts of 1K..2K tokens next to PyTorch SDPA
#                   (SPARSE_PREFILL_BENCH_ARGS=--quick: fewer shapes)
#         serve     `tandem up --device cuda` (prefill and decode workers sharing the GPU, caches over TCP
#                   through host staging) checked by scripts/serve-check.py against `tandem generate --device cuda`
#         serve-v32 `tandem up --device cuda` with the synthetic model (V32_MODEL, default
#                   synthetic:v32,experts=32; prefill and decode workers sharing the GPU) under `tandem bench`
#                   (SERVE_BENCH_ARGS; default 64 fixed prompts of 1024 tokens, 128 out, 16 at a time): throughput,
#                   TTFT, ITL in $OUT/serve-v32.json
#         kv        kv-transfer between GPU memory pools with the packed CUDA-capable UCX (libucx-cu13): the
#                   cross-process GPU tests (kv-transfer/tests/gpu_transfer.rs), `tandem up --device cuda
#                   --kv-transport ucx` checked against `tandem generate` (prefill on GPU 0, decode on the last
#                   GPU), kv-bench --devices next to ucx_perftest on CUDA memory and a device-to-device copy
#         kv-trace  kv-bench --devices with kv-transfer's trace events (KV_TRACE_ARGS; default 1K and 8K tokens, 62
#                   layers, 3 requests), contiguous and scattered: where a request's time goes
#         ep        expert parallelism on 2 GPUs (engine::cuda::ep): engine/tests/ep.rs (EP-2 logits == one GPU's, bit
#                   for bit; a stopped or killed rank ends the other's steps, and the group is formed again;
#                   TANDEM_REQUIRE_GPUS=2; load balancing moving experts keeps the bits), the groups of one under
#                   compute-sanitizer memcheck, then two engine-bench ranks (--ep) with EP_MODEL (default
#                   synthetic:v32,layers=4,experts=128): the exchange at EP_EXCHANGE rows per rank next to plain
#                   NCCL all-to-alls ($OUT/ep-exchange.jsonl), and EP_BENCH_ARGS measurements at EP-2 and on one GPU
#                   ($OUT/ep-bench-rank{0,1}.json, ep-bench-one.json)
#         serve-ep  expert-parallel workers in the cluster (2 GPUs): `tandem up --device cuda --decode 4 --decode-ep 2`
#                   (two decode groups of two ranks, one rank of each on each GPU; EP_DECODE and EP_DECODE_EP
#                   change the layout, e.g. 4 and 4 on four GPUs) checked by scripts/serve-check.py
#                   against `tandem generate --device cuda`; scripts/fault-check.py SIGKILLs a decode rank while 8
#                   streams of EP_FAULT_TOKENS (3000) decode, and SIGSTOPs another group's leader for 6 s: every
#                   stream must end with generate's text; the restarted group serves again; then
#                   `--prefill 2 --prefill-ep 2` checked the same way
#         eplb      expert-parallel load balancing on 2 GPUs under skewed routing: two engine-bench ranks (--ep) with
#                   EPLB_MODEL (default synthetic:v32,experts=128,skew=8) and EPLB_ARGS, first without moving
#                   experts (loads counted: what balancing would gain), then with --eplb EPLB_FLAGS (default 8 spare
#                   slots a rank, a look every 4 busy steps over the last 4 looks), each after EPLB_WARMUP untimed
#                   steps: $OUT/eplb-{off,on}-rank{0,1}.json (extra.eplb: max/mean GPU load as sharded and as placed)
#         epgraph   decode graphs under expert parallelism on 2 GPUs: two engine-bench ranks (--ep --graphs-ab) with
#                   EPGRAPH_MODEL (default synthetic:v32,experts=8) and EPGRAPH_ARGS, --dbo off then on: each batch timed
#                   with its decode passes (and their exchanges) replayed as CUDA graphs, then eagerly
#                   ($OUT/epgraph-dbo{off,on}-rank{0,1}.json); fails where a timed step replayed no graph
#         dbo       dual-batch overlap on 2 GPUs: two engine-bench ranks (--ep) with DBO_MODEL (default
#                   synthetic:v32,experts=128) and DBO_ARGS, with --dbo off (and --kernel-profile: the exchange's
#                   share of the step) then --dbo on (and --timeline): $OUT/dbo-{off,on}-rank{0,1}.json,
#                   $OUT/dbo-timeline.json and an SVG per measurement (bench/gpu/timeline_plot.py)
#         all       kernels, sass, loop, sanitize, model, serve
#       The Python kernel benchmarks (bench/gpu/*_bench.py) compile engine/kernels on the device with nvcc;
#       TANDEM_LOOP_DEFINES adds -D flags (a kernel's variants timed in one call), and for the benchmarks that go
#       through scripts/kernel-loop.py (sparse-mla, sparse-prefill, indexer, ...) TANDEM_LOOP_COMPILER=nvrtc
#       compiles with NVRTC instead, the engine's compiler. bench/gpu/sparse_bits.py compares two trees' sparse
#       MLA outputs bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-carry
LIMIT=$((64 * 1024 * 1024))

pack() {
    command -v xz >/dev/null || { echo "gpu-test.sh: xz is needed to compress the bundle" >&2; exit 1; }
    cargo build --release --bin tandem
    cargo build --release -p engine --bin engine-bench
    # The engine's unit tests (engine-tests) and the integration tests that run on the GPU.
    local built pairs=("tandem:target/release/tandem" "engine-bench:target/release/engine-bench")
    built=$(cargo test --release -p engine --lib --test model --test golden --test gpu --test synthetic --test ep --no-run \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        name = "engine-tests" if t["name"] == "engine" and "lib" in t["kind"] else "engine-" + t["name"]
        print(name + ":" + m["executable"])')
    for want in engine-tests engine-model engine-golden engine-gpu engine-synthetic engine-ep; do
        grep -q "^$want:" <<<"$built" || { echo "gpu-test.sh: test binary $want not built" >&2; exit 1; }
    done
    mapfile -t -O 2 pairs <<<"$built"
    # kv-transfer with cache pools in GPU memory: kv-bench, kv-peer and the cross-process GPU test.
    cargo build --release -p kv-transfer --features cuda,tools --bin kv-bench --bin kv-peer
    local kv
    kv=$(cargo test --release -p kv-transfer --features cuda,tools --test gpu_transfer --no-run \
        --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
    [[ -n "$kv" ]] || { echo "gpu-test.sh: kv-transfer's gpu_transfer test not built" >&2; exit 1; }
    pairs+=("kv-bench:target/release/kv-bench" "kv-peer:target/release/kv-peer" "kv-gpu-transfer:$kv")
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE"
    local name src
    for pair in "${pairs[@]}"; do
        name=${pair%%:*}
        src=${pair#*:}
        strip -o "$BUNDLE/$name" "$src"
        xz -T0 -6 "$BUNDLE/$name"
    done
    pack_ucx
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

# A CUDA-capable UCX for the GPU machine (its own libucp has no CUDA modules): the libucx-cu13 wheel
# (ENV-NOTES), trimmed to the libraries, the CUDA and cma modules, ucx_info and ucx_perftest with its CUDA
# memory module, as gpu-carry/ucx.tar.xz. The wheel is downloaded once into .whl/ (ignored by git).
UCX_WHEEL_VERSION=1.22.0
pack_ucx() {
    local whl dir
    whl=$(ls .whl/libucx_cu13-"$UCX_WHEEL_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
    if [[ -z "$whl" ]]; then
        python3 -m pip download --no-deps "libucx-cu13==$UCX_WHEEL_VERSION" -d .whl >/dev/null
        whl=$(ls .whl/libucx_cu13-"$UCX_WHEEL_VERSION"-*.whl | head -n 1)
    fi
    dir=$(mktemp -d)
    python3 -m zipfile -e "$whl" "$dir/whl"
    mkdir -p "$dir/ucx/libucx/bin" "$dir/ucx/libucx/lib/ucx" "$dir/ucx/libucx_cu13.libs"
    local f
    for f in libucp libuct libucs libucm; do cp "$dir/whl/libucx/lib/$f.so.0.0.0" "$dir/ucx/libucx/lib/$f.so.0"; done
    for f in libuct_cuda libucm_cuda libuct_cma libucx_perftest_cuda; do
        cp "$dir/whl/libucx/lib/ucx/$f.so.0.0.0" "$dir/ucx/libucx/lib/ucx/$f.so.0"
    done
    cp "$dir/whl/libucx/bin/ucx_info" "$dir/whl/libucx/bin/ucx_perftest" "$dir/ucx/libucx/bin/"
    cp "$dir"/whl/libucx_cu13.libs/* "$dir/ucx/libucx_cu13.libs/"
    chmod +x "$dir"/ucx/libucx/bin/*
    tar -C "$dir" -cf - ucx | xz -T0 -6 >"$BUNDLE/ucx.tar.xz"
    rm -rf "$dir"
}

unpack() {
    mkdir -p /tmp/tandem-gpu
    for f in "$BUNDLE"/*.xz; do
        [[ $f == */ucx.tar.xz ]] && continue
        xz -dc "$f" >"/tmp/tandem-gpu/$(basename "$f" .xz)"
        chmod +x "/tmp/tandem-gpu/$(basename "$f" .xz)"
    done
    [[ -f "$BUNDLE/ucx.tar.xz" ]] && xz -dc "$BUNDLE/ucx.tar.xz" | tar -C /tmp/tandem-gpu -xf -
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
    "$@" /tmp/tandem-gpu/engine-tests ${TEST_FILTER:-cuda::} --test-threads=1 ${TEST_SKIP:-} >"$log" 2>&1 || rc=$?
    # A sanitizer's report can land between a test's name and its result: anything but ok/ignored there is a
    # failure, listed as FAILED with the start of what was printed.
    grep -E '^test .* \.\.\. ' "$log" | sed -E -e 's/^test (.*) \.\.\. (ok|ignored|FAILED)$/| '"$label"' | \1 | \2 |/' \
        -e 's/^test (.*) \.\.\. (.*)$/| '"$label"' | \1 | FAILED (\2) |/' >>"$SUMMARY" || true
    local skipped
    skipped=$(grep -c '^skipped:' "$log" || true)
    echo "| $label | (skipped messages) | $skipped |" >>"$SUMMARY"
    if ((rc != 0)) || grep -q 'ERROR SUMMARY: [1-9]' "$log"; then
        FAILED+=("$label")
        tail -n 30 "$log"
    fi
}

phase_kernels() { run_tests kernels; }

# One integration-test binary on the GPU, its rows appended to $SUMMARY.
run_binary() {
    local label=$1 bin=$2
    shift 2
    local log="$OUTDIR/$label.log" rc=0
    TANDEM_TEST_DEVICE=cuda TANDEM_GOLDEN_ROOT="$PWD/tests/golden" "/tmp/tandem-gpu/$bin" --test-threads=1 --nocapture "$@" \
        >"$log" 2>&1 || rc=$?
    # --nocapture interleaves the tests' measurements with libtest's lines: a test failed when it is listed
    # under "failures:" at the end, passed otherwise (the binary's exit status agrees).
    local failed_tests name
    failed_tests=$(sed -n '/^failures:$/,/^test result/p' "$log" | grep -E '^    [a-z_:0-9]+$' | tr -d ' ' || true)
    for name in $(grep -oE '^test [a-z_:0-9]+ \.\.\.' "$log" | awk '{print $2}'); do
        if grep -qx "$name" <<<"$failed_tests"; then
            echo "| $label | $name | FAILED |" >>"$SUMMARY"
        else
            echo "| $label | $name | ok |" >>"$SUMMARY"
        fi
    done
    if ((rc != 0)); then
        FAILED+=("$label")
        tail -n 40 "$log"
    fi
}

phase_model() {
    run_binary gpu-vs-cpu engine-gpu
    run_binary model engine-model
    run_binary golden engine-golden
    run_binary synthetic engine-synthetic
    # The CLI end to end on the GPU: a checkpoint, greedy generation, JSON out.
    local rc=0 dir=/tmp/tandem-gpu/tiny
    {
        tandem gen-tiny "$dir" &&
            tandem generate --model "$dir" --device cuda --prompt-ids 11,12,13,14,15 --max-tokens 16 --json
    } >"$OUTDIR/generate.log" 2>&1 || rc=$?
    tail -n 5 "$OUTDIR/generate.log"
    echo "| generate | tandem generate --device cuda | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(generate)
}

phase_sanitize() {
    run_tests memcheck compute-sanitizer --tool memcheck --error-exitcode 1
    # racecheck tracks every shared-memory access: the sampler's 1024-thread CTAs over 129K-entry rows take
    # minutes per test under it, so it checks the sampler on its tie-heavy and small-vocabulary cases only.
    TEST_SKIP="--skip cuda::sample::tests::many_seeds --skip cuda::sample::tests::tokens_and_logprobs \
--skip cuda::sample::tests::top_logprobs --skip cuda::sample::tests::results_depend \
--skip cuda::sample::tests::penalties_bias" \
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

# FlashMLA built in FLASHMLA_SRC (once per machine) and on PYTHONPATH, where FLASHMLA_SRC is set; non-zero
# when the build failed (the phase then fails: its baseline is missing).
with_flashmla() {
    local rc=0
    if [[ -n "${FLASHMLA_SRC:-}" ]]; then
        if ! ls "$FLASHMLA_SRC"/flash_mla/cuda*.so >/dev/null 2>&1; then
            echo "building FlashMLA in $FLASHMLA_SRC (the same-run baseline)"
            (cd "$FLASHMLA_SRC" && CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl FLASH_MLA_DISABLE_SM100=1 \
                MAX_JOBS=16 NVCC_THREADS=2 python3 setup.py build_ext --inplace >"$OUTDIR/flashmla-build.log" 2>&1) || rc=$?
            tail -2 "$OUTDIR/flashmla-build.log"
        fi
        export PYTHONPATH="$FLASHMLA_SRC${PYTHONPATH:+:$PYTHONPATH}"
    fi
    return $rc
}

# A benchmark phase next to FlashMLA: `name` (its log, JSON and summary row), its script and extra arguments.
flashmla_phase() {
    local name=$1 script=$2 args=$3 rc=0
    with_flashmla || rc=$?
    python3 "$script" $args --json "$OUTDIR/$name.json" >"$OUTDIR/$name.log" 2>&1 || rc=$?
    grep -v "warning #\|^ *\^\|Remark\|state;\|Deprecation\|  fn()\|prepare(" "$OUTDIR/$name.log" || true
    echo "| $name | $script | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=("$name")
}

phase_sparse_prefill() { flashmla_phase sparse-prefill bench/gpu/sparse_prefill_bench.py "${SPARSE_PREFILL_BENCH_ARGS:-}"; }

phase_sparse_mla() { flashmla_phase sparse-mla bench/gpu/sparse_mla_bench.py "${SPARSE_MLA_BENCH_ARGS:-}"; }

phase_gemm() {
    local rc=0
    python3 bench/gpu/gemm_bench.py ${GEMM_BENCH_ARGS:-} --json "$OUTDIR/gemm.json" >"$OUTDIR/gemm.log" 2>&1 || rc=$?
    grep -v "^invariance: M\|^check" "$OUTDIR/gemm.log" || true
    echo "| gemm | bench/gpu/gemm_bench.py | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(gemm)
}

phase_v32() {
    local rc=0 model=${V32_MODEL:-synthetic:v32,experts=32}
    for grouped in ${V32_GROUPED:-1}; do
        TANDEM_MOE_GROUPED=$grouped engine-bench --device cuda --model "$model" --json \
            --out "$OUTDIR/engine-bench-v32-grouped$grouped.json" \
            ${V32_ARGS:---batches 1,16,64 --context 2048 --blocks 4096 --decode-steps 4 --mtp} --kernel-profile \
            >"$OUTDIR/engine-bench-v32-grouped$grouped.log" 2>&1 || rc=$?
        tail -n 12 "$OUTDIR/engine-bench-v32-grouped$grouped.log"
        # Tokens/s per GPU of the EP rank the model stands for (assumptions printed with it).
        python3 bench/gpu/projection.py --bench "$OUTDIR/engine-bench-v32-grouped$grouped.json" \
            --json "$OUTDIR/projection-v32-grouped$grouped.json" || true
        # Time per kernel per step (bench/gpu/kernel_plot.py; the split of the profiled runs).
        python3 bench/gpu/kernel_plot.py "$OUTDIR/engine-bench-v32-grouped$grouped.json" \
            --out "$OUTDIR/kernels-v32-grouped$grouped.svg" --title "$model, grouped experts $grouped" || true
    done
    echo "| v32 | engine-bench --model $model | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(v32)
}

# A PyTorch benchmark script as a phase: bench/gpu/NAME_bench.py with $ARGS, its log shown and kept, its JSON out.
python_bench_phase() {
    local name=$1 args=$2 rc=0
    python3 "bench/gpu/${name}_bench.py" $args --json "$OUTDIR/$name.json" >"$OUTDIR/$name.log" 2>&1 || rc=$?
    cat "$OUTDIR/$name.log"
    echo "| $name | bench/gpu/${name}_bench.py | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=("$name")
}

phase_indexer() { python_bench_phase indexer "${INDEXER_BENCH_ARGS:-}"; }
phase_moe() { python_bench_phase moe "${MOE_BENCH_ARGS:-}"; }
phase_bf16() { python_bench_phase bf16 "${BF16_BENCH_ARGS:-}"; }
phase_f32() { python_bench_phase f32 "${F32_BENCH_ARGS:-}"; }

phase_serve() {
    local rc=0 dir=/tmp/tandem-gpu/tiny up
    [[ -f "$dir/tokenizer.json" ]] || tandem gen-tiny "$dir" >/dev/null
    tandem generate --model "$dir" --device cuda --prompt "The quick brown fox" --max-tokens 12 --ignore-eos --json \
        >"$OUTDIR/generate-cuda.json" 2>"$OUTDIR/generate-cuda.log" || rc=$?
    if ((rc == 0)); then
        tandem up --model "$dir" --served-model-name tandem-tiny --device cuda --kv-transport "${KV_TRANSPORT:-tcp}" --port 18000 \
            --grpc-port 18001 >"$OUTDIR/up.log" 2>&1 &
        up=$!
        for _ in $(seq 1 120); do
            curl -sf http://127.0.0.1:18000/ready >/dev/null 2>&1 && break
            kill -0 "$up" 2>/dev/null || break
            sleep 1
        done
        python3 scripts/serve-check.py http://127.0.0.1:18000 tandem-tiny "$OUTDIR/generate-cuda.json" \
            >"$OUTDIR/serve-check.log" 2>&1 || rc=$?
        cat "$OUTDIR/serve-check.log"
        kill -INT "$up" 2>/dev/null || true
        wait "$up" 2>/dev/null || true
        tail -n 20 "$OUTDIR/up.log"
    else
        cat "$OUTDIR/generate-cuda.log"
    fi
    echo "| serve | tandem up --device cuda --kv-transport ${KV_TRANSPORT:-tcp} + scripts/serve-check.py | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(serve)
}

phase_serve_v32() {
    local rc=0 up model=${V32_MODEL:-synthetic:v32,experts=32}
    # Building and loading the model takes minutes on the first start: tandem up's own stage timeout too.
    tandem up --model "$model" --device cuda --kv-transport tcp --port 18010 --grpc-port 18011 \
        --ready-timeout 450 >"$OUTDIR/up-v32.log" 2>&1 &
    up=$!
    rc=1
    for _ in $(seq 1 480); do
        curl -sf -m 5 http://127.0.0.1:18010/ready >/dev/null 2>&1 && { rc=0; break; }
        kill -0 "$up" 2>/dev/null || break
        sleep 1
    done
    if ((rc == 0)); then
        tandem bench --base-url http://127.0.0.1:18010 --vocab-size 129280 \
            ${SERVE_BENCH_ARGS:---dataset fixed --input-len 1024 --output-len 128 --num-prompts 64 --max-concurrency 16} \
            --disable-progress --json "$OUTDIR/serve-v32.json" >"$OUTDIR/serve-v32.log" 2>&1 || rc=$?
        cat "$OUTDIR/serve-v32.log"
        # tandem bench succeeds when any request does: every one must.
        python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(d["failed"] != 0 or d["completed"] != d["num_prompts"])' \
            "$OUTDIR/serve-v32.json" || rc=1
    fi
    kill -INT "$up" 2>/dev/null || true
    timeout 90 tail --pid="$up" -f /dev/null || kill -KILL "$up" 2>/dev/null || true
    tail -n 20 "$OUTDIR/up-v32.log"
    echo "| serve-v32 | tandem up --model $model + tandem bench | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(serve-v32)
}

# kv-transfer between GPUs through the packed CUDA-capable UCX: the cross-process GPU tests, the cluster
# over UCX, then kv-bench with device pools (sender GPU 0, receiver the last GPU), contiguous and scattered
# block tables, each next to ucx_perftest on CUDA memory (same transport, the mean message size, and one
# request-sized message) and a device-to-device copy of the same bytes, all in this run. KV_BENCH_ARGS
# replaces the sizes and repetitions.
phase_kv() {
    local rc=0 ucx=/tmp/tandem-gpu/ucx last
    export LD_LIBRARY_PATH="$ucx/libucx/lib:$ucx/libucx_cu13.libs:$LD_LIBRARY_PATH" PATH="$ucx/libucx/bin:$PATH"
    last=$(($(nvidia-smi -L | wc -l) - 1))
    {
        ucx_info -v
        ucx_info -d | grep -E 'Memory domain|Transport|Device:' | tr -s ' '
        nvidia-smi topo -m
    } >"$OUTDIR/ucx-info.log" 2>&1 || true
    grep -E 'Library version|cuda_ipc|cuda_copy' "$OUTDIR/ucx-info.log" | sort -u || true
    TANDEM_KV_PEER=/tmp/tandem-gpu/kv-peer run_binary kv-gpu kv-gpu-transfer
    # The cluster end to end over UCX: `tandem up --device cuda` puts prefill on GPU 0 and decode on GPU 1
    # (both on GPU 0 with one), and its text must equal `tandem generate --device cuda`.
    KV_TRANSPORT=ucx phase_serve
    grep -E 'kv-transfer UCX started' "$OUTDIR/up.log" | head -n 4 || true
    # Which protocols UCX picks (a small run with UCX_PROTO_INFO).
    UCX_PROTO_INFO=y timeout 60 kv-bench --transport ucx --devices "0,$last" --tokens 8192 --layers 4 --reps 1 \
        --json --no-perftest --no-baselines >/dev/null 2>"$OUTDIR/kv-bench-proto.log" || true
    grep -E 'cuda_ipc' "$OUTDIR/kv-bench-proto.log" | sed 's/^.*\] *//' | sort | uniq -c | head -n 6 || true
    local mode
    for mode in contiguous scattered; do
        local flag=""
        [[ $mode == scattered ]] && flag=--scattered
        timeout 240 kv-bench --transport ucx --devices "0,$last" $flag \
            ${KV_BENCH_ARGS:---tokens 1024,8192,32768 --layers 62 --reps 5} --json \
            >"$OUTDIR/kv-bench-device-$mode.jsonl" 2>"$OUTDIR/kv-bench-device-$mode.log" || rc=$?
        cat "$OUTDIR/kv-bench-device-$mode.jsonl"
        tail -n 3 "$OUTDIR/kv-bench-device-$mode.log"
    done
    echo "| kv | kv-bench --devices 0,$last (contiguous, scattered) | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(kv)
}

# kv-bench between the GPUs with kv-transfer's trace events (per chunk: the sender's buffer wait and gather, the
# receiver's announce, landing and scatter; per request: handshake, drain, completion), untimed baselines off.
phase_kv_trace() {
    local rc=0 ucx=/tmp/tandem-gpu/ucx last mode
    export LD_LIBRARY_PATH="$ucx/libucx/lib:$ucx/libucx_cu13.libs:$LD_LIBRARY_PATH" PATH="$ucx/libucx/bin:$PATH"
    last=$(($(nvidia-smi -L | wc -l) - 1))
    for mode in contiguous scattered; do
        local flag=""
        [[ $mode == scattered ]] && flag=--scattered
        # shellcheck disable=SC2086
        RUST_LOG=kv_transfer=trace NO_COLOR=1 timeout 120 kv-bench --transport ucx --devices "0,$last" $flag \
            ${KV_TRACE_ARGS:---tokens 1024,8192 --layers 62 --reps 3} --no-perftest --no-baselines --json \
            >"$OUTDIR/kv-trace-$mode.jsonl" 2>"$OUTDIR/kv-trace-$mode.log" || rc=$?
        cat "$OUTDIR/kv-trace-$mode.jsonl"
    done
    echo "| kv-trace | kv-bench --devices 0,$last with trace events | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(kv-trace)
}

# cudarc opens libnccl.so: where only PyTorch's libnccl.so.2 exists, a link to it on the library path.
nccl_lib() {
    ldconfig -p 2>/dev/null | grep -q 'libnccl.so ' && return 0
    local so
    so=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
    [[ -n "$so" && -f "$so" ]] || so=$(ls /usr/lib/x86_64-linux-gnu/libnccl.so.2 2>/dev/null || true)
    [[ -n "$so" ]] || { echo "gpu-test.sh: no libnccl found" >&2; return 1; }
    mkdir -p /tmp/tandem-gpu/lib && ln -sf "$so" /tmp/tandem-gpu/lib/libnccl.so
    export LD_LIBRARY_PATH="/tmp/tandem-gpu/lib:$LD_LIBRARY_PATH"
}

phase_ep() {
    nccl_lib
    TANDEM_REQUIRE_GPUS=2 run_binary ep engine-ep
    # The exchange's kernels under memcheck, in one process (a group of one rank).
    if [[ ${EP_SANITIZE:-1} == 1 ]] && command -v compute-sanitizer >/dev/null; then
        local src=0
        # Both groups of one: the plain exchange, and experts moving between slots (load balancing).
        TANDEM_TEST_DEVICE=cuda compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 /tmp/tandem-gpu/engine-ep \
            a_group_of_one --test-threads=1 --nocapture \
            >"$OUTDIR/ep-memcheck.log" 2>&1 || src=$?
        tail -n 3 "$OUTDIR/ep-memcheck.log"
        echo "| ep | memcheck: a_group_of_one (plain, experts moving) | $([[ $src == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
        ((src == 0)) || FAILED+=(ep-memcheck)
    fi
    local rc=0 r port=$((29500 + RANDOM % 1000)) model=${EP_MODEL:-synthetic:v32,layers=4,experts=128}
    local args=${EP_BENCH_ARGS:---decode-only --batches 16 --context 512 --decode-steps 4}
    for r in 0 1; do
        # shellcheck disable=SC2086
        timeout 400 engine-bench --device "cuda:$r" --ep "$r/2@127.0.0.1:$port" --model "$model" \
            --ep-exchange "${EP_EXCHANGE:-16,64,256,1024,4096}" $args --json --out "$OUTDIR/ep-bench-rank$r.json" \
            >"$OUTDIR/ep-bench-rank$r.log" 2>&1 &
    done
    wait -n || rc=$?
    wait -n || rc=$?
    grep -h '"ep_exchange"' "$OUTDIR/ep-bench-rank0.log" >"$OUTDIR/ep-exchange.jsonl" || true
    tail -n 4 "$OUTDIR"/ep-bench-rank*.log
    # shellcheck disable=SC2086
    timeout 300 engine-bench --device cuda:0 --model "$model" $args --json --out "$OUTDIR/ep-bench-one.json" \
        >"$OUTDIR/ep-bench-one.log" 2>&1 || rc=$?
    tail -n 3 "$OUTDIR/ep-bench-one.log"
    echo "| ep | engine-bench --ep (2 ranks) and one GPU | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(ep)
}

phase_eplb() {
    nccl_lib
    local rc=0 mode r model=${EPLB_MODEL:-synthetic:v32,experts=128,skew=8}
    local args=${EPLB_ARGS:---batches 32,128 --context 256 --decode-steps 8 --blocks 4096}
    local warm=${EPLB_WARMUP:-12} flags=${EPLB_FLAGS:---eplb-redundant 8 --eplb-interval 4 --eplb-window 4}
    for mode in off on; do
        local port=$((29500 + RANDOM % 1000)) extra="--eplb-interval 4"
        [[ $mode == on ]] && extra="--eplb $flags"
        for r in 0 1; do
            # shellcheck disable=SC2086
            timeout 500 engine-bench --device "cuda:$r" --ep "$r/2@127.0.0.1:$port" --model "$model" $args \
                --warmup-steps "$warm" $extra --json --out "$OUTDIR/eplb-$mode-rank$r.json" \
                >"$OUTDIR/eplb-$mode-rank$r.log" 2>&1 &
        done
        wait -n || rc=$?
        wait -n || rc=$?
        tail -n 4 "$OUTDIR"/eplb-$mode-rank*.log
    done
    python3 - "$OUTDIR" <<'PY' || rc=$?
import json, sys
out = sys.argv[1]
print("| run | rank | tok/s | step or call ms | max/mean as sharded | as placed | layers moved (timed) |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mode in ("off", "on"):
    for r in (0, 1):
        for row in json.load(open(f"{out}/eplb-{mode}-rank{r}.json")):
            e = row["extra"].get("eplb", {})
            ms = 1e3 * row["extra"].get("step_s", row["seconds"])
            print(f"| {row['bench']} eplb {mode} | {r} | {row['tokens_per_s']:.1f} | {ms:.1f} | "
                  f"{e.get('imbalance_shard', 0):.3f} | {e.get('imbalance_now', 0):.3f} | "
                  f"{e.get('layers_moved', 0)} ({row['extra'].get('eplb_moved_while_timed', '-')}) |")
PY
    echo "| eplb | engine-bench --ep (2 ranks), without and with --eplb | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(eplb)
}

phase_dbo() {
    nccl_lib
    local rc=0 mode r model=${DBO_MODEL:-synthetic:v32,experts=128}
    local args=${DBO_ARGS:---batches 32,64,128,256 --context 256 --decode-steps 8 --blocks 8192 --warmup-steps 2}
    for mode in off on; do
        local port=$((29500 + RANDOM % 1000)) extra="--dbo off --kernel-profile"
        [[ $mode == on ]] && extra="--dbo on --timeline $OUTDIR/dbo-timeline.json"
        for r in 0 1; do
            # shellcheck disable=SC2086
            timeout 500 engine-bench --device "cuda:$r" --ep "$r/2@127.0.0.1:$port" --model "$model" $args $extra \
                --json --out "$OUTDIR/dbo-$mode-rank$r.json" >"$OUTDIR/dbo-$mode-rank$r.log" 2>&1 &
        done
        wait -n || rc=$?
        wait -n || rc=$?
        tail -n 3 "$OUTDIR"/dbo-$mode-rank*.log
    done
    python3 bench/gpu/timeline_plot.py "$OUTDIR/dbo-timeline.json" --summary >"$OUTDIR/dbo-overlap.jsonl" || rc=$?
    local b
    for b in $(python3 -c 'import json,sys; print(" ".join(k for k, v in json.load(open(sys.argv[1])).items() if v))' "$OUTDIR/dbo-timeline.json"); do
        python3 bench/gpu/timeline_plot.py "$OUTDIR/dbo-timeline.json" --bench "$b" --out "$OUTDIR/dbo-timeline-$b.svg" || rc=$?
    done
    python3 - "$OUTDIR" <<'PY' || rc=$?
import json, sys
out = sys.argv[1]
rows = {m: {r["bench"]: r for r in json.load(open(f"{out}/dbo-{m}-rank0.json"))} for m in ("off", "on")}
hidden = {}
for line in open(f"{out}/dbo-overlap.jsonl"):
    o = json.loads(line)
    hidden[o["bench"]] = o
print("| measurement | off ms | exchange share (off) | on ms | on / off | exchanges hidden (on) |")
print("|---|---:|---:|---:|---:|---:|")
for bench, off in rows["off"].items():
    on = rows["on"].get(bench)
    ms = lambda r: 1e3 * r["extra"].get("step_s", r["seconds"])
    ks = off["extra"].get("kernels", [])
    comm = sum(k["seconds"] for k in ks if k["name"].startswith("nccl_ep_"))
    share = comm / off["extra"]["kernel_s"] if off["extra"].get("kernel_s") else 0
    h = hidden.get(bench, {})
    print(f"| {bench} | {ms(off):.1f} | {100 * share:.0f}% | {ms(on):.1f} | {ms(on) / ms(off):.3f} | "
          f"{100 * h.get('hidden_share', 0):.0f}% of {h.get('exchange_ms', 0):.1f} ms |")
PY
    echo "| dbo | engine-bench --ep (2 ranks), --dbo off and on | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(dbo)
}

# One `tandem up` layout (its extra flags) until ready on port 18020; the up process id in UP_PID.
up_ep() {
    local name=$1
    shift
    # A 3 s step bound (the workers read it from the environment tandem up passes on): a 6 s SIGSTOP is a lost rank.
    TANDEM_EP_STEP_TIMEOUT_SECS=${EP_STEP_TIMEOUT:-3} tandem up --model /tmp/tandem-gpu/tiny --served-model-name tandem-tiny \
        --device cuda --kv-transport tcp --port 18020 --grpc-port 18021 --ready-timeout 240 "$@" >"$OUTDIR/up-ep-$name.log" 2>&1 &
    UP_PID=$!
    local i
    for i in $(seq 1 240); do
        curl -sf http://127.0.0.1:18020/ready >/dev/null 2>&1 && return 0
        kill -0 "$UP_PID" 2>/dev/null || break
        sleep 1
    done
    tail -n 30 "$OUTDIR/up-ep-$name.log"
    return 1
}

# A check of the serve-ep phase: runs the command, logs it, and adds its row.
ep_check() {
    local what=$1 src=0
    shift
    echo "== $what" >>"$OUTDIR/serve-ep.log"
    if declare -F "$1" >/dev/null; then
        "$@" >>"$OUTDIR/serve-ep.log" 2>&1 || src=$?
    else
        timeout 400 "$@" >>"$OUTDIR/serve-ep.log" 2>&1 || src=$?
    fi
    echo "| serve-ep | $what | $([[ $src == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((src == 0)) || FAILED+=("serve-ep: $what")
    return $src
}

# Waits until `pattern` appears `n` times in the layout's log (ranks that joined a group), at most 180 s.
wait_log() {
    local log=$1 pattern=$2 n=$3 i
    for i in $(seq 1 180); do
        (($(grep -c "$pattern" "$log" || true) >= n)) && return 0
        sleep 1
    done
    return 1
}

phase_epgraph() {
    nccl_lib
    local rc=0 mode r model=${EPGRAPH_MODEL:-synthetic:v32,experts=8}
    local args=${EPGRAPH_ARGS:---decode-only --batches 1,16,64 --context 256 --decode-steps 8 --blocks 4096 --mtp --warmup-steps 2}
    for mode in off on; do
        local port=$((29500 + RANDOM % 1000))
        for r in 0 1; do
            # shellcheck disable=SC2086
            timeout 500 engine-bench --device "cuda:$r" --ep "$r/2@127.0.0.1:$port" --model "$model" $args \
                --dbo "$mode" --graphs-ab --json --out "$OUTDIR/epgraph-dbo$mode-rank$r.json" \
                >"$OUTDIR/epgraph-dbo$mode-rank$r.log" 2>&1 &
        done
        wait -n || rc=$?
        wait -n || rc=$?
        tail -n 3 "$OUTDIR"/epgraph-dbo$mode-rank*.log
    done
    python3 - "$OUTDIR" <<'PY' || rc=$?
import json, sys
out = sys.argv[1]
print("| dbo | rank | batch | graphs ms | eager ms | eager / graphs | timed replays | GPU idle between calls (graphs, eager) |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
bad = []
for mode in ("off", "on"):
    for r in (0, 1):
        rows = {x["bench"]: x for x in json.load(open(f"{out}/epgraph-dbo{mode}-rank{r}.json"))}
        for name, g in rows.items():
            if not name.startswith("decode_batch_") or name.endswith("_eager"):
                continue
            e = rows[name + "_eager"]
            ms = lambda x: 1e3 * x["extra"]["step_s"]
            rep = g["extra"].get("graphs", {}).get("timed_replays", 0)
            if rep == 0:
                bad.append(f"dbo {mode} rank {r} {name}: no replay")
            idle = lambda x: x["extra"].get("gpu_idle_between_calls", 0)
            print(f"| {mode} | {r} | {g['extra']['batch']} | {ms(g):.2f} | {ms(e):.2f} | {ms(e) / ms(g):.3f} | {rep} | "
                  f"{100 * idle(g):.0f}%, {100 * idle(e):.0f}% |")
if bad:
    sys.exit("; ".join(bad))
PY
    echo "| epgraph | engine-bench --ep (2 ranks) --graphs-ab, --dbo off and on | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(epgraph)
}

phase_serve_ep() {
    nccl_lib
    local dir=/tmp/tandem-gpu/tiny gen=$OUTDIR/generate-cuda.json long=$OUTDIR/generate-cuda-long.json log
    [[ -f "$dir/tokenizer.json" ]] || tandem gen-tiny "$dir" >/dev/null
    : >"$OUTDIR/serve-ep.log"
    ep_check "tandem generate --device cuda" bash -c "tandem generate --model $dir --device cuda --prompt 'The quick brown fox' \
        --max-tokens 12 --ignore-eos --json >$gen && tandem generate --model $dir --device cuda \
        --prompt 'The quick brown fox' --max-tokens ${EP_FAULT_TOKENS:-3000} --ignore-eos --json >$long" || return 0
    # EP_DECODE decode workers in groups of EP_DECODE_EP (defaults 4 and 2: two groups on two GPUs; with one
    # group, a lost rank's requests wait for the group's restart).
    local n=${EP_DECODE:-4} g=${EP_DECODE_EP:-2}
    log=$OUTDIR/up-ep-decode.log
    if ep_check "tandem up --decode $n --decode-ep $g ready" up_ep decode --decode "$n" --decode-ep "$g"; then
        ep_check "decode EP: serve-check" python3 scripts/serve-check.py http://127.0.0.1:18020 tandem-tiny "$gen"
        ep_check "decode EP: SIGKILL of a rank under 8 streams" python3 scripts/fault-check.py http://127.0.0.1:18020 \
            tandem-tiny "$long" "decode-worker 1/$g@" KILL 8
        ep_check "decode EP: the group re-forms" wait_log "$log" "expert-parallel group joined" $((n + g))
        ep_check "decode EP: serve-check after the restart" python3 scripts/serve-check.py http://127.0.0.1:18020 tandem-tiny "$gen"
        ep_check "decode EP: SIGSTOP of a leader for 6 s" python3 scripts/fault-check.py http://127.0.0.1:18020 \
            tandem-tiny "$long" "decode-worker 0/$g@" STOP 8
        ep_check "decode EP: the group re-forms again" wait_log "$log" "expert-parallel group joined" $((n + 2 * g))
        ep_check "decode EP: serve-check at the end" python3 scripts/serve-check.py http://127.0.0.1:18020 tandem-tiny "$gen"
        curl -s http://127.0.0.1:18020/metrics | grep -E 'tandem_router_retries_total' >>"$OUTDIR/serve-ep.log" || true
    fi
    kill -INT "$UP_PID" 2>/dev/null || true
    timeout 60 tail --pid="$UP_PID" -f /dev/null || kill -KILL "$UP_PID" 2>/dev/null || true
    grep -E 'exited|restarted|group joined|group failure|lost mid-stream' "$log" | cut -c1-240 | head -n 40 >>"$OUTDIR/serve-ep.log" || true
    if ep_check "tandem up --prefill 2 --prefill-ep 2 ready" up_ep prefill --prefill 2 --prefill-ep 2; then
        ep_check "prefill EP: serve-check" python3 scripts/serve-check.py http://127.0.0.1:18020 tandem-tiny "$gen"
    fi
    kill -INT "$UP_PID" 2>/dev/null || true
    timeout 60 tail --pid="$UP_PID" -f /dev/null || kill -KILL "$UP_PID" 2>/dev/null || true
    tail -n 40 "$OUTDIR/serve-ep.log"
}

phase_bench() {
    local rc=0
    for prec in fp8 full; do
        engine-bench --device cuda --precision "$prec" --json --out "$OUTDIR/engine-bench-cuda-$prec.json" \
            >"$OUTDIR/engine-bench-$prec.log" 2>&1 || rc=$?
        cat "$OUTDIR/engine-bench-$prec.log"
    done
    echo "| bench | engine-bench --device cuda | $([[ $rc == 0 ]] && echo ok || echo FAILED) |" >>"$SUMMARY"
    ((rc == 0)) || FAILED+=(bench)
    # Where a decode step's time goes: every kernel of a few steps, timed by Nsight Compute.
    if command -v ncu >/dev/null; then
        ncu --csv --metrics gpu__time_duration.sum --launch-skip 2000 --launch-count 400 \
            engine-bench --device cuda --decode-only >"$OUTDIR/ncu-decode.csv" 2>"$OUTDIR/ncu-decode.log" || true
        python3 - "$OUTDIR/ncu-decode.csv" <<'PY' || true
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no ncu rows")
head = rows[0]
k, v = head.index("Kernel Name"), head.index("Metric Value")
t = collections.Counter()
for r in rows[1:]:
    try:
        t[r[k]] += float(r[v].replace(",", ""))
    except ValueError:
        pass
total = sum(t.values())
print("kernel time share over %d launches (%.1f us):" % (len(rows) - 1, total / 1e3))
for name, ns in t.most_common(12):
    print("  %-40s %6.1f%%  %9.1f us" % (name[:40], 100 * ns / total, ns / 1e3))
PY
    fi
}

run() {
    local phase=${1:?usage: gpu-test.sh run kernels|sass|loop|sanitize|model|bench|indexer|gemm|moe|bf16|f32|sparse-mla|sparse-prefill|serve|v32|serve-v32|kv|kv-trace|ep|serve-ep|eplb|dbo|epgraph|all}
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
        model) phase_model ;;
        bench) phase_bench ;;
        indexer) phase_indexer ;;
        gemm) phase_gemm ;;
        moe) phase_moe ;;
        bf16) phase_bf16 ;;
        f32) phase_f32 ;;
        v32) phase_v32 ;;
        serve-v32) phase_serve_v32 ;;
        sparse-mla) phase_sparse_mla ;;
        sparse-prefill) phase_sparse_prefill ;;
        serve) phase_serve ;;
        kv) phase_kv ;;
        kv-trace) phase_kv_trace ;;
        ep) phase_ep ;;
        serve-ep) phase_serve_ep ;;
        eplb) phase_eplb ;;
        dbo) phase_dbo ;;
        epgraph) phase_epgraph ;;
        all) phase_sass; phase_kernels; phase_loop; phase_model; phase_serve; phase_sanitize ;;
        *) echo "gpu-test.sh: unknown phase $phase" >&2; exit 2 ;;
    esac
    local passed failed
    passed=$(grep -c '| ok |$' "$SUMMARY" || true)
    failed=$(grep -cE '\| FAILED( \(.*\))? \|$' "$SUMMARY" || true)
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
    *) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
