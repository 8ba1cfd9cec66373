"""Repository-level tests (docs, examples, packaging): helpers live in launch.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
