"""Time per kernel per step as an SVG: one stacked bar per measurement of `engine-bench --kernel-profile`.

  python3 bench/gpu/kernel_plot.py ENGINE_BENCH.json [...] --out FILE.svg [--top 10]

Each measurement with `extra.kernels` (prefill_N: per prefill call; decode_batch_B: per decode step) becomes
a bar: its `--top` longest kernels over all bars in their own colors, the rest as "other kernels", and for
decode the share of the unprofiled step in which no kernel ran ("GPU idle": step_s - kernel_s). Bars are
scaled to their own total (the label gives the milliseconds), so kernels compare across batch sizes by share.
No plotting library: the SVG is written directly (the GPU machine and CI have none).
"""
import argparse
import html
import json
import sys

COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
          "#86bcb6", "#d37295", "#a0cbe8"]
OTHER, IDLE = "#bab0ac", "#ffffff"


def load(path):
    text = open(path).read().strip()
    rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line]
    return [r for r in rows if "kernels" in r.get("extra", {})]


def short(name):
    return name.removeprefix("tandem_")


def bars(rows, top):
    totals = {}
    for r in rows:
        for k in r["extra"]["kernels"]:
            totals[k["name"]] = totals.get(k["name"], 0.0) + k["seconds"] / max(r["extra"]["kernel_s"], 1e-12)
    named = [n for n, _ in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]
    out = []
    for r in rows:
        e = r["extra"]
        parts = [(n, sum(k["seconds"] for k in e["kernels"] if k["name"] == n)) for n in named]
        parts.append(("other kernels", sum(k["seconds"] for k in e["kernels"] if k["name"] not in named)))
        if "step_s" in e:
            parts.append(("GPU idle", max(e["step_s"] - e["kernel_s"], 0.0)))
        # The profiled kernels can sum past the unprofiled step (engine-bench: gpu_idle is biased low).
        total = max(e.get("step_s", 0.0), e["kernel_s"])
        label = "%s (%s)" % (r["bench"], r.get("model", "?"))
        if "context" in e:
            label = "%s, context %d%s" % (r["bench"], e["context"], ", MTP" if e.get("mtp") else "")
        out.append((label, total, parts))
    return named, out


def svg(named, rows, title):
    colors = {n: COLORS[i % len(COLORS)] for i, n in enumerate(named)}
    colors["other kernels"], colors["GPU idle"] = OTHER, IDLE
    width, left, bar_w, bar_h, gap = 1100, 330, 560, 26, 12
    legend_h = 22 * ((len(colors) + 1) // 2)
    height = 60 + len(rows) * (bar_h + gap) + 30 + legend_h
    s = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'
         % (width, height), '<rect width="100%" height="100%" fill="white"/>',
         '<text x="10" y="24" font-size="15">%s</text>' % html.escape(title)]
    y = 50
    for label, total, parts in rows:
        s.append('<text x="%d" y="%d" text-anchor="end">%s</text>' % (left - 8, y + bar_h - 8, html.escape(label)))
        x = left
        for name, sec in parts:
            w = bar_w * sec / total if total > 0 else 0
            if w <= 0:
                continue
            s.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s" stroke="#555" stroke-width="0.3">'
                     '<title>%s: %.3f ms (%.1f%%)</title></rect>'
                     % (x, y, w, bar_h, colors[name], html.escape(name), sec * 1e3, 100 * sec / total))
            x += w
        s.append('<text x="%d" y="%d">%.2f ms</text>' % (left + bar_w + 8, y + bar_h - 8, total * 1e3))
        y += bar_h + gap
    y += 20
    for i, name in enumerate(list(named) + ["other kernels", "GPU idle"]):
        lx, ly = 10 + (i % 2) * 540, y + 22 * (i // 2)
        s.append('<rect x="%d" y="%d" width="14" height="14" fill="%s" stroke="#555" stroke-width="0.5"/>'
                 % (lx, ly, colors[name]))
        s.append('<text x="%d" y="%d">%s</text>' % (lx + 20, ly + 12, html.escape(short(name))))
    s.append("</svg>")
    return "\n".join(s) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="*", help="engine-bench --json output (one object per line, or a list)")
    ap.add_argument("--out", help="SVG file to write")
    ap.add_argument("--self-test", action="store_true", help="check the bars and the SVG on made-up rows")
    ap.add_argument("--top", type=int, default=10, help="kernels shown by name (default 10)")
    ap.add_argument("--title", default="GPU time per kernel (engine-bench --kernel-profile)")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.bench or not a.out:
        ap.error("give engine-bench JSON files and --out")
    rows = [r for f in a.bench for r in load(f)]
    if not rows:
        sys.exit("kernel_plot.py: no measurement with extra.kernels (run engine-bench with --kernel-profile)")
    named, bars_ = bars(rows, a.top)
    with open(a.out, "w") as f:
        f.write(svg(named, bars_, a.title))
    for label, total, parts in bars_:
        print("%-40s %8.3f ms: %s" % (label, total * 1e3, ", ".join(
            "%s %.0f%%" % (short(n), 100 * s / total) for n, s in sorted(parts, key=lambda p: -p[1])[:5] if s > 0)))


def self_test():
    k = lambda name, sec: {"name": name, "launches": 1, "seconds": sec}  # noqa: E731
    rows = [{"bench": "decode_batch_8", "extra": {"context": 1024, "mtp": True, "step_s": 0.010, "kernel_s": 0.008,
                                                  "kernels": [k("tandem_a", 0.005), k("tandem_b", 0.002),
                                                              k("tandem_c", 0.001)]}},
            {"bench": "prefill_512", "model": "m", "extra": {"kernel_s": 0.5, "kernels": [k("tandem_a", 0.5)]}}]
    named, b = bars(rows, 2)
    assert named == ["tandem_a", "tandem_b"], named
    label, total, parts = b[0]
    assert label == "decode_batch_8, context 1024, MTP" and total == 0.010, (label, total)
    got = dict(parts)
    assert got["other kernels"] == 0.001 and abs(got["GPU idle"] - 0.002) < 1e-12, got
    assert b[1][1] == 0.5 and "GPU idle" not in dict(b[1][2]), b[1]
    out = svg(named, b, "t")
    assert out.count("<rect") == 1 + 5 + 4, out.count("<rect")  # page, bar parts (not the empty ones), legend
    print("kernel_plot.py self-test: ok")


if __name__ == "__main__":
    main()
