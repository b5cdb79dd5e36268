#!/usr/bin/env bash
# Interleaved A/B of kv-bench between two GPUs: a base commit's kv-bench and this tree's, alternating
# (contiguous and scattered tables, three rounds), same machine, same device call; medians of the rounds.
#
# Here: build the base (`git worktree add /tmp/base <commit>`, then in it `CARGO_TARGET_DIR=target-base
# cargo build --release -p kv-transfer --features cuda --bin kv-bench`), strip and `xz` it to
# gpu-carry/kv-bench-base.xz after `scripts/gpu-test.sh pack`, and copy this script to gpu-carry/.
# On the GPU machine, after `scripts/gpu-test.sh run kv` unpacked the bundle (its UCX and binaries under
# /tmp/tandem-gpu): `bash gpu-carry/ab-device.sh DIR`. Writes DIR/ab-<arm>-<mode>-<round>.jsonl and prints
# the table (each round's median request: a build with an extra warm-up request must not gain from it).
# AB_ARMS (default "base new") lists the arms: `base` or `new`, optionally with one variable for that arm's
# runs (`new@TANDEM_KV_SPIN_US=200`). AB_TOKENS (default 1024,8192,32768,131072), AB_REPS (5).
# Results: bench/kv-transfer/h200x2-ab/ (2026-11-28), h200x2-fixed/ab/ (the fixed costs, same day).
set -u
D=$1
ucx=/tmp/tandem-gpu/ucx
export LD_LIBRARY_PATH="$ucx/libucx/lib:$ucx/libucx_cu13.libs:${LD_LIBRARY_PATH:-}" PATH="$ucx/libucx/bin:$PATH"
xz -dc gpu-carry/kv-bench-base.xz > /tmp/tandem-gpu/kv-bench-base && chmod +x /tmp/tandem-gpu/kv-bench-base
last=$(($(nvidia-smi -L | wc -l) - 1))
read -r -a arms <<<"${AB_ARMS:-base new}"
for arm in "${arms[@]}"; do
    case $arm in
        base | new | base@?*=* | new@?*=*) ;;
        *) echo "ab-device.sh: arm '$arm' is not base or new, optionally @NAME=VALUE" >&2; exit 2 ;;
    esac
done
for round in 1 2 3; do
    for mode in contiguous scattered; do
        flag=""
        [[ $mode == scattered ]] && flag=--scattered
        for arm in "${arms[@]}"; do
            build=${arm%%@*}
            setting=(LC_ALL=C)
            [[ $arm == *@* ]] && setting+=("${arm#*@}")
            exe=/tmp/tandem-gpu/kv-bench
            [[ $build == base ]] && exe=/tmp/tandem-gpu/kv-bench-base
            name=${arm//[@=]/_}
            # shellcheck disable=SC2086
            env "${setting[@]}" timeout 120 "$exe" --transport ucx --devices "0,$last" $flag \
                --tokens "${AB_TOKENS:-1024,8192,32768,131072}" --layers 62 --reps "${AB_REPS:-5}" \
                --no-perftest --no-baselines --json >"$D/ab-$name-$mode-$round.jsonl" 2>"$D/ab-$name-$mode-$round.log"
            echo "$arm $mode $round rc=$?"
        done
    done
done
python3 - "$D" "${arms[@]}" <<'PY'
import json, sys, glob, collections
d, arms = sys.argv[1], [a.replace("@", "_").replace("=", "_") for a in sys.argv[2:]]
rows = collections.defaultdict(list)
for arm in arms:
    for f in sorted(glob.glob(f"{d}/ab-{arm}-*-[0-9].jsonl")):
        mode = f.rsplit("/", 1)[1][len(f"ab-{arm}-"):].rsplit("-", 1)[0]
        for l in open(f):
            j = json.loads(l)
            rows[(mode, j["tokens"], arm)].append(j["ms_per_request_median"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("mode tokens | ms per request, each round's median request, per arm | medians of the rounds relative to the first arm")
for mode, tok in sorted({(m, t) for m, t, _ in rows}):
    base = med(rows[(mode, tok, arms[0])])
    cells = [f"{a}: {rows[(mode, tok, a)]}" for a in arms]
    rel = [f"{a} {base / med(rows[(mode, tok, a)]):.3f}x" for a in arms[1:]]
    print(mode, tok, "|", " | ".join(cells), "|", ", ".join(rel))
PY
