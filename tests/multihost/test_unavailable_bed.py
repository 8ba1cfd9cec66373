"""When the multi-host tests fail rather than skip without a test bed (no bed needed)."""

from __future__ import annotations

import pytest
import testbed


@pytest.mark.parametrize("ci", ["true", "TRUE", "1", "yes", " true\n"])
def test_ci_as_root_fails(ci):
    assert testbed.must_fail(ci, 0)


@pytest.mark.parametrize("ci", [None, "", "false", "0", "no"])
def test_outside_ci_as_root_skips(ci):
    assert not testbed.must_fail(ci, 0)


@pytest.mark.parametrize("ci", [None, "true"])
def test_not_root_skips(ci):
    # Without root namespaces cannot be made; CI without root has no bed to expect.
    assert not testbed.must_fail(ci, 1000)
