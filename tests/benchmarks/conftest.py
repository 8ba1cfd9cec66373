"""The scaling model's modules live in benchmarks/ (scripts, not a package): import from there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
