#!/usr/bin/env python3
"""Draws one step of a loom trace.json (log.trace) as an SVG timeline.

    scripts/trace_svg.py RUN/trace.json out.svg [--step N]

A row per rank, a box per instruction: forwards blue, backwards green
(zero-bubble: input gradients teal, weight gradients orange), the gradient
reduction grey, the optimizer step purple. Standard library only.
"""
import argparse
import json
from xml.sax.saxutils import escape

COLOURS = {
    "forward": "#4e79a7",
    "backward": "#59a14f",
    "backward_input": "#76b7b2",
    "backward_weight": "#f28e2b",
    "reduce_grads": "#bab0ac",
    "optimizer_step": "#b07aa1",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("svg")
    ap.add_argument("--step", type=int, default=2, help="the step to draw (default 2)")
    ap.add_argument("--width", type=int, default=1000)
    a = ap.parse_args()
    events = json.load(open(a.trace))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    # The pipeline's instructions (the compute and communication rows are
    # for a trace viewer).
    boxes = [e for e in events if e.get("ph") == "X" and e["args"].get("step") == a.step
             and e.get("cat") not in ("compute", "comm")]
    if not boxes:
        raise SystemExit(f"{a.trace}: no slices of step {a.step}")
    t0 = min(e["ts"] for e in boxes)
    t1 = max(e["ts"] + e["dur"] for e in boxes)
    ranks = sorted({e["pid"] for e in boxes})
    left, row, top = 190, 28, 30
    scale = (a.width - left - 10) / (t1 - t0)
    height = top + row * len(ranks) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{a.width}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{a.width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="12">step {a.step}: '
           f'{(t1 - t0) / 1e3:.1f} ms (boxes: F forward, B backward, W weight gradients; '
           'micro-batch.chunk)</text>']
    for i, r in enumerate(ranks):
        y = top + i * row
        out.append(f'<text x="4" y="{y + 17}">{escape(names.get(r, f"rank {r}"))}</text>')
        out.append(f'<line x1="{left}" y1="{y + row - 2}" x2="{a.width - 10}" y2="{y + row - 2}" '
                   'stroke="#eee"/>')
        for e in (e for e in boxes if e["pid"] == r):
            x, w = left + (e["ts"] - t0) * scale, max(e["dur"] * scale, 0.5)
            out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 8}" '
                       f'fill="{COLOURS.get(e["cat"], "#999")}" stroke="white" stroke-width="0.5">'
                       f'<title>{escape(e["name"])} {e["dur"] / 1e3:.2f} ms</title></rect>')
            label = e["name"] if e["cat"] not in ("reduce_grads", "optimizer_step") else ""
            if label and w > 7 * len(label):
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + 17}" text-anchor="middle" '
                           f'fill="white">{escape(label)}</text>')
    y = top + row * len(ranks) + 20
    out.append(f'<text x="{left}" y="{y}">0 ms</text>')
    out.append(f'<text x="{a.width - 10}" y="{y}" text-anchor="end">{(t1 - t0) / 1e3:.1f} ms</text>')
    out.append("</svg>")
    open(a.svg, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
