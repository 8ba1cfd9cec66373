"""The one exception class of tnt_data."""

from __future__ import annotations


class DistributionError(ValueError):
    """A dataset cannot be split across ranks as asked.

    The message names the problem, the transformation involved (if any) and the fix.
    """
