"""The stages of an overlapped (dual-batch) pass on a timeline, as an SVG, with how much of the exchange ran
under compute.

  python3 bench/gpu/timeline_plot.py TIMELINE.json --bench decode_batch_128 --out FILE.svg [--layers 3]
  python3 bench/gpu/timeline_plot.py TIMELINE.json --summary

TIMELINE.json is `engine-bench --ep ... --timeline FILE`: per measurement, the stages of one untimed call
(engine::cuda::ep::StageTime: lane main or comm, micro-batch 0 or 1, what, start and end in ms from the
first stage, from CUDA events). The main stream's stages are `front` (attention, routing, shared expert),
`experts` and `finish` (the combine); the second stream's are `dispatch` and `combine` (the NCCL exchanges).

The plot shows the whole call scaled to the width, and below it a window of `--layers` MoE layers from the
middle of the call. The summary gives, per measurement, the exchange time on the second stream and the part
of it during which the main stream was inside a stage (hidden under compute). A stage's span on the main
stream includes the time the stream waits for an event inside it, so "hidden" is an upper bound where a
stage begins with a wait. No plotting library: the SVG is written directly.
"""
import argparse
import html
import json
import sys

COLORS = {(0, "front"): "#4e79a7", (0, "experts"): "#a0cbe8", (0, "finish"): "#2f4b7c",
          (1, "front"): "#f28e2b", (1, "experts"): "#ffbe7d", (1, "finish"): "#b3590a",
          (0, "dispatch"): "#59a14f", (0, "combine"): "#8cd17d", (1, "dispatch"): "#e15759", (1, "combine"): "#ff9d9a"}


def merged(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(spans, busy):
    total = 0.0
    for a, b in spans:
        for c, d in busy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def summary(stages):
    comm = [(s["start_ms"], s["end_ms"]) for s in stages if s["lane"] == "comm"]
    main = merged([(s["start_ms"], s["end_ms"]) for s in stages if s["lane"] == "main"])
    comm_ms = sum(b - a for a, b in comm)
    hidden = overlap(merged(comm), main)
    end = max((s["end_ms"] for s in stages), default=0.0)
    return {"call_ms": end, "exchange_ms": comm_ms, "hidden_ms": hidden,
            "hidden_share": hidden / comm_ms if comm_ms else 0.0}


def lanes_svg(stages, t0, t1, x0, y0, width, title):
    rows = [("main", 0), ("main", 1), ("comm", 0), ("comm", 1)]
    names = {("main", 0): "main A", ("main", 1): "main B", ("comm", 0): "comm A", ("comm", 1): "comm B"}
    h, gap = 18, 4
    scale = width / max(t1 - t0, 1e-9)
    out = [f'<text x="{x0}" y="{y0 - 6}" font-size="12">{html.escape(title)}</text>']
    for i, key in enumerate(rows):
        y = y0 + i * (h + gap)
        out.append(f'<text x="{x0 - 6}" y="{y + 13}" font-size="11" text-anchor="end">{names[key]}</text>')
        out.append(f'<rect x="{x0}" y="{y}" width="{width}" height="{h}" fill="#f4f4f4"/>')
        for s in stages:
            if (s["lane"], s["micro"]) != key or s["end_ms"] < t0 or s["start_ms"] > t1:
                continue
            a, b = max(s["start_ms"], t0), min(s["end_ms"], t1)
            color = COLORS.get((s["micro"], s["what"]), "#bab0ac")
            tip = f'{s["what"]} {s["start_ms"]:.3f}-{s["end_ms"]:.3f} ms'
            out.append(f'<rect x="{x0 + (a - t0) * scale:.2f}" y="{y}" width="{max((b - a) * scale, 0.5):.2f}" '
                       f'height="{h}" fill="{color}"><title>{html.escape(tip)}</title></rect>')
    y = y0 + len(rows) * (h + gap) + 12
    out.append(f'<text x="{x0}" y="{y}" font-size="10">{t0:.2f} ms</text>')
    out.append(f'<text x="{x0 + width}" y="{y}" font-size="10" text-anchor="end">{t1:.2f} ms</text>')
    return out, y + 20


def plot(stages, bench, layers):
    width, x0 = 1100, 70
    end = max(s["end_ms"] for s in stages)
    fronts = sorted(s["start_ms"] for s in stages if s["lane"] == "main" and s["micro"] == 0 and s["what"] == "front")
    mid = len(fronts) // 2
    w0 = fronts[mid] if fronts else 0.0
    w1 = fronts[min(mid + layers, len(fronts) - 1)] if len(fronts) > mid + layers else end
    s = summary(stages)
    out = [f'<text x="{x0}" y="18" font-size="14">{html.escape(bench)}: dual-batch overlap, '
           f'{s["exchange_ms"]:.2f} ms of exchanges, {100 * s["hidden_share"]:.0f}% under main-stream stages '
           f'(call {s["call_ms"]:.2f} ms)</text>']
    part, y = lanes_svg(stages, 0.0, end, x0, 46, width, "the whole call")
    out += part
    part, y = lanes_svg(stages, w0, w1, x0, y + 16, width, f"{layers} layers from the middle")
    out += part
    legend_x = x0
    for (micro, what), color in COLORS.items():
        label = f'{"AB"[micro]} {what}'
        out.append(f'<rect x="{legend_x}" y="{y}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{legend_x + 16}" y="{y + 10}" font-size="11">{label}</text>')
        legend_x += 100
    height = y + 30
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{x0 + width + 20}" height="{height}" '
            f'font-family="sans-serif">\n' + "\n".join(out) + "\n</svg>\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--bench")
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--summary", action="store_true")
    a = ap.parse_args()
    data = json.load(open(a.timeline))
    if a.summary:
        for bench, stages in data.items():
            if stages:
                print(json.dumps({"bench": bench, **summary(stages)}))
        return
    stages = data.get(a.bench or "")
    if not stages:
        sys.exit(f"timeline_plot: no overlapped stages for {a.bench!r} (have: {', '.join(k for k, v in data.items() if v)})")
    svg = plot(stages, a.bench, a.layers)
    if a.out:
        open(a.out, "w").write(svg)
    else:
        sys.stdout.write(svg)


if __name__ == "__main__":
    main()
