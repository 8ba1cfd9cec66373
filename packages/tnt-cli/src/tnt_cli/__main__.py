"""`python -m tnt_cli` is the same as the `tarantella` command."""

import sys

from tnt_cli.cli import main

sys.exit(main())
