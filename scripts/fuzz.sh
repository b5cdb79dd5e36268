#!/usr/bin/env bash
# Long fuzz runs: the property-based fuzz tests that `scripts/test.sh` runs bounded (a few hundred cases
# each), with TANDEM_FUZZ_CASES cases each (default 20000), then a summary. Exits non-zero when any
# target fails; a failing case is printed minimized (proptest), to be kept as a regression test.
#
#   TANDEM_FUZZ_CASES=100000 scripts/fuzz.sh [target ...]
#
# Targets (default: all): http grpc schemathesis kv-frames kv-ucx kv-descriptors config safetensors tokenizer.
# kv-ucx sets up a UCX endpoint per case (about a second each): give it fewer cases, e.g.
# TANDEM_FUZZ_CASES=2000 scripts/fuzz.sh kv-ucx.
# schemathesis runs TANDEM_FUZZ_CASES / 100 examples per operation and needs the venv scripts/test.sh makes.
set -uo pipefail
cd "$(dirname "$0")/.."

export TANDEM_FUZZ_CASES="${TANDEM_FUZZ_CASES:-20000}"
[[ -x .venv/bin/python ]] && export TANDEM_PYTHON="${TANDEM_PYTHON:-$PWD/.venv/bin/python}"

declare -A TESTS=(
    [http]="-p router --test fuzz http_bodies"
    [grpc]="-p router --test fuzz grpc_requests"
    [schemathesis]="-p router --test fuzz schemathesis"
    [kv-frames]="-p kv-transfer --test fuzz wire_frames"
    [kv-ucx]="-p kv-transfer --test fuzz_ucx"
    [kv-descriptors]="-p kv-transfer --test fuzz a_descriptor"
    [config]="-p engine --test fuzz config"
    [safetensors]="-p engine --test fuzz safetensors"
    [tokenizer]="-p text --test fuzz"
)
ORDER=(http grpc schemathesis kv-frames kv-ucx kv-descriptors config safetensors tokenizer)

targets=("$@")
((${#targets[@]})) || targets=("${ORDER[@]}")
for t in "${targets[@]}"; do
    [[ -n "${TESTS[$t]:-}" ]] || { echo "fuzz.sh: unknown target '$t' (known: ${ORDER[*]})" >&2; exit 2; }
done

# Build once, quietly, so the timings below are the runs.
cargo test -q -p router -p kv-transfer -p engine -p text --test fuzz --no-run || exit 1
cargo test -q -p kv-transfer --test fuzz_ucx --no-run || exit 1

logs=$(mktemp -d)
summary=()
failed=0
for t in "${targets[@]}"; do
    start=$SECONDS
    # shellcheck disable=SC2086 # the table holds cargo arguments
    if cargo test -q ${TESTS[$t]} -- --test-threads 1 >"$logs/$t.log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed=1
    fi
    summary+=("$(printf '%-16s %-7s %5ss' "$t" "$status" $((SECONDS - start)))")
    echo "fuzz.sh: $t $status ($((SECONDS - start)) s)" >&2
done

echo
echo "fuzz summary ($TANDEM_FUZZ_CASES cases per property; logs in $logs)"
printf '%s\n' "${summary[@]}"
if ((failed)); then
    for t in "${targets[@]}"; do
        grep -q "test result: ok" "$logs/$t.log" && continue
        echo
        echo "=== $t ==="
        grep -E "panicked|minimal failing input|Test failed" -A12 "$logs/$t.log" | cut -c1-2000 | head -60
    done
    exit 1
fi
