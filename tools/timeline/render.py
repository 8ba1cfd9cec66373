"""Render a tarantella timeline (Chrome-trace JSON) to a PNG, one band per rank.

    python tools/timeline/render.py trace.json out.png [--title T] [--step K]

Each rank gets a compute row (F blue, B green, W orange; data-parallel traces have no
compute events: their step runs as one traced graph) and a communication row (sends
purple, receive waits grey, gradient-sync buckets teal from submit to done, waits red).
``--step K`` draws only step K (counted from 0 in the file; the window from the first
to the last pass of that step over all ranks, or of the K-th wait for data parallelism).
Needs Pillow (in the keras nox environment; matplotlib is not installed there).
"""

from __future__ import annotations

import argparse
import json
import sys

from PIL import Image, ImageDraw, ImageFont

COLORS = {"forward": (66, 133, 244), "backward": (52, 168, 83), "weight": (251, 140, 0),
          "send": (142, 68, 173), "recv": (170, 170, 170), "bucket": (0, 150, 136), "wait": (219, 68, 55),
          "sync": (0, 150, 136)}
COMPUTE = ("forward", "backward", "weight")
W, LEFT, RIGHT, TOP, ROW, GAP = 1200, 90, 20, 40, 26, 14


def _window(events: list[dict], step: int | None) -> tuple[float, float]:
    if step is None:
        return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    steps = sorted({e["args"]["step"] for e in events if "step" in e.get("args", {})})
    if steps:
        k = steps[step]
        mine = [e for e in events if e.get("args", {}).get("step") == k and e["cat"] in (*COMPUTE, "send", "recv")]
    else:  # data parallelism: per rank, the buckets after its (step-1)-th wait up to its step-th
        mine = []
        for r in sorted({e["pid"] for e in events}):
            waits = sorted((e for e in events if e["cat"] == "wait" and e["pid"] == r), key=lambda e: e["ts"])
            end = waits[step]["ts"] + waits[step]["dur"]
            start = waits[step - 1]["ts"] + waits[step - 1]["dur"] if step > 0 else float("-inf")
            mine += [e for e in events if e["pid"] == r and start <= e["ts"] and e["ts"] + e["dur"] <= end + 1]
    return min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)


def render(trace: dict, out: str, title: str = "", step: int | None = None) -> None:
    """Draw ``trace`` (optionally one step of it) into the PNG ``out``."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] != "step"]
    events.sort(key=lambda e: e["cat"] == "wait")  # waits drawn over the buckets they end
    ranks = sorted({e["pid"] for e in events})
    lo, hi = _window(events, step)
    scale = (W - LEFT - RIGHT) / max(hi - lo, 1.0)
    height = TOP + len(ranks) * (2 * ROW + GAP) + 50
    img = Image.new("RGB", (W, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    d.text((LEFT, 8), title, fill="black", font=font)
    for k, r in enumerate(ranks):
        y0 = TOP + k * (2 * ROW + GAP)
        d.text((6, y0 + 6), f"rank {r}", fill="black", font=font)
        d.text((6, y0 + ROW + 6), "comm", fill=(90, 90, 90), font=font)
        for e in events:
            if e["pid"] != r or e["ts"] + e["dur"] < lo or e["ts"] > hi:
                continue
            x0 = LEFT + (max(e["ts"], lo) - lo) * scale
            x1 = max(x0 + 1, LEFT + (min(e["ts"] + e["dur"], hi) - lo) * scale)
            y = y0 if e["cat"] in COMPUTE else y0 + ROW
            d.rectangle([x0, y + 2, x1, y + ROW - 2], fill=COLORS.get(e["cat"], (0, 0, 0)),
                        outline="white" if x1 - x0 > 3 else None)
            if e["cat"] in COMPUTE and x1 - x0 > 16:
                d.text((x0 + 3, y + 7), e["name"], fill="white", font=font)
    # time axis, ms from the window's start
    ya = TOP + len(ranks) * (2 * ROW + GAP)
    d.line([LEFT, ya, W - RIGHT, ya], fill="black")
    span_ms = (hi - lo) / 1e3
    tick = next(t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 1e4)
                if span_ms / t <= 12)
    t = 0.0
    while t <= span_ms + 1e-9:
        x = LEFT + t * 1e3 * scale
        d.line([x, ya, x, ya + 4], fill="black")
        d.text((x - 8, ya + 6), f"{t:g}", fill="black", font=font)
        t += tick
    d.text((W - RIGHT - 30, ya + 22), "ms", fill="black", font=font)
    x = LEFT + 60
    for cat in ("forward", "backward", "weight", "send", "recv", "bucket", "wait"):
        d.rectangle([x, ya + 22, x + 10, ya + 32], fill=COLORS[cat])
        label = {"forward": "F", "backward": "B", "weight": "W", "recv": "recv wait", "bucket": "bucket submit-done"}
        d.text((x + 14, ya + 22), label.get(cat, cat), fill="black", font=font)
        x += 30 + 7 * len(label.get(cat, cat))
    img.save(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--title", default="")
    p.add_argument("--step", type=int, default=None)
    a = p.parse_args(argv)
    with open(a.trace) as f:
        render(json.load(f), a.out, a.title, a.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
