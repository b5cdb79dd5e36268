#!/usr/bin/env bash
# Interleaved A/B of kv-bench between two GPUs: a base commit's kv-bench and this tree's, alternating
# (contiguous and scattered tables, three rounds), same machine, same device call; medians of the rounds.
#
# Here: build the base (`git worktree add /tmp/base <commit>`, then in it `CARGO_TARGET_DIR=target-base
# cargo build --release -p kv-transfer --features cuda --bin kv-bench`), strip and `xz` it to
# gpu-carry/kv-bench-base.xz after `scripts/gpu-test.sh pack`, and copy this script to gpu-carry/.
# On the GPU machine, after `scripts/gpu-test.sh run kv` unpacked the bundle (its UCX and binaries under
# /tmp/tandem-gpu): `bash gpu-carry/ab-device.sh DIR`. Writes DIR/ab-<build>-<mode>-<round>.jsonl and prints
# the table. Results of 2026-11-28: bench/kv-transfer/h200x2-ab/.
set -u
D=$1
ucx=/tmp/tandem-gpu/ucx
export LD_LIBRARY_PATH="$ucx/libucx/lib:$ucx/libucx_cu13.libs:$LD_LIBRARY_PATH" PATH="$ucx/libucx/bin:$PATH"
xz -dc gpu-carry/kv-bench-base.xz > /tmp/tandem-gpu/kv-bench-base && chmod +x /tmp/tandem-gpu/kv-bench-base
last=$(($(nvidia-smi -L | wc -l) - 1))
for round in 1 2 3; do
    for mode in contiguous scattered; do
        flag=""
        [[ $mode == scattered ]] && flag=--scattered
        for build in base new; do
            exe=/tmp/tandem-gpu/kv-bench
            [[ $build == base ]] && exe=/tmp/tandem-gpu/kv-bench-base
            # shellcheck disable=SC2086
            timeout 120 "$exe" --transport ucx --devices "0,$last" $flag --tokens 1024,8192,32768,131072 --layers 62 \
                --reps 5 --no-perftest --no-baselines --json >"$D/ab-$build-$mode-$round.jsonl" 2>"$D/ab-$build-$mode-$round.log"
            echo "$build $mode $round rc=$?"
        done
    done
done
python3 - "$D" <<'PY'
import json, sys, glob, collections
d = sys.argv[1]
rows = collections.defaultdict(list)
for f in sorted(glob.glob(f"{d}/ab-*.jsonl")):
    _, build, mode, rnd = f.rsplit("/", 1)[1][:-6].split("-")
    for l in open(f):
        j = json.loads(l)
        rows[(mode, j["tokens"], build)].append(j["ms_per_request"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("mode tokens | base ms | new ms (each round's mean) | base/new (medians)")
for (mode, tok, build) in sorted(k for k in rows if k[2] == "base"):
    b, n = rows.get((mode, tok, "base"), []), rows.get((mode, tok, "new"), [])
    print(mode, tok, "|", b, "|", n, "|", round(med(b) / med(n), 3))
PY
