"""``python -m tarantella.native``: build the native ops now (e.g. once per cluster
image, before a job starts many ranks) and say whether they are in use."""

from __future__ import annotations

import sys

from . import library_path, ops


def main() -> int:
    path = library_path()
    module = ops()
    if module is None:
        from . import why_not

        print(f"tarantella native ops: NOT in use ({why_not}); collectives use tf.numpy_function")
        return 1
    print(f"tarantella native ops: in use ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
