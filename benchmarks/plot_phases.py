"""Draw benchmarks/sharded_phases.py's traces: RSS of one rank over the timed steps, with
its reduce-scatters and allgathers shaded, one panel per trace (docs/sharding.md's picture).

    python benchmarks/plot_phases.py OUT.png "label A=trace_a.0.json" "label B=trace_b.0.json"

Needs matplotlib only (no TensorFlow): `nox -s bench` installs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, panels = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    traces = [(label, json.loads(Path(f).read_text())) for label, f in panels]
    for _, tr in traces:  # the timed steps only (the sampler runs on until fit returns)
        last = max(t for t, n in tr["events"] if n == "end") + 0.1
        tr["samples"] = [s for s in tr["samples"] if s[0] <= last]
    top = max(r for _, tr in traces for _, r in tr["samples"])
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.6 * len(traces)), sharex=True, squeeze=False)
    for ax, (label, tr) in zip(axes[:, 0], traces):
        t = [s[0] for s in tr["samples"]]
        ax.plot(t, [s[1] for s in tr["samples"]], color="black", linewidth=0.8)
        opened: dict[str, float] = {}
        for when, name in tr["events"]:
            kind, edge = name[:2], name[2:]
            if kind in ("rs", "ag") and edge == "0":
                opened[kind] = when
            elif kind in ("rs", "ag") and edge == "1" and kind in opened:
                ax.axvspan(opened.pop(kind), when, color="tab:orange" if kind == "rs" else "tab:blue",
                           alpha=0.35, linewidth=0)
            elif name == "step":
                ax.axvline(when, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylim(min(0.0, min(s[1] for s in tr["samples"])) - 10, top * 1.08)
        ax.set_ylabel("MiB above step 1")
        ax.set_title(f"{label} (rank {tr['rank']}, peak {max(s[1] for s in tr['samples']):.0f} MiB)", fontsize=10)
    axes[-1, 0].set_xlabel("seconds from the first timed step (dotted: step starts; orange: reduce-scatter; "
                           "blue: allgather)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
