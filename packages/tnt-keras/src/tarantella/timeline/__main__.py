"""``python -m tarantella.timeline summary trace.json``: print a timeline's per-rank summary."""

from __future__ import annotations

import argparse
import json
import sys

from ._merge import load
from ._summary import format_summary, summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tarantella.timeline",
                                     description="Summarise a timeline written by tnt.timeline / TNT_TIMELINE.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="per rank: compute, exposed communication, overlap, idle, slowest stage")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        trace = load(args.path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(trace)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
