"""The examples' learning figures once more with oneDNN off (issue 34).

oneDNN picks other kernels per CPU instruction set, so the summation order and with it a
short training run's outcome move from one machine to the next. Running the examples with
``TF_ENABLE_ONEDNN_OPTS=0`` as well as on (the other tests) exercises a second set of
numerics on every machine. The figures and bars are those of tools/example_margins.py,
which mirrors the tests that assert them (checked below) and measures their margins.
"""

from __future__ import annotations

import re
import sys

import pytest
from launch import ROOT, explain

sys.path.insert(0, str(ROOT / "tools"))
import example_margins as margins


@pytest.fixture(scope="module")
def onednn_off():
    """Every learning example in one 2-rank launch, oneDNN off, default seeds."""
    return margins.run_variant(onednn=False, seed_offset=0, python=sys.executable)


@pytest.mark.parametrize("name", list(margins.FIGURES))
def test_figure_clears_its_bar_with_onednn_off(onednn_off, name):
    figures, proc = onednn_off
    value, fig = figures[name], margins.FIGURES[name]
    assert value is not None, f"{fig.script} printed no {name}: {explain(proc)}"
    if fig.higher_is_better:
        assert value >= fig.threshold, (name, value)
    else:
        assert value <= fig.threshold, (name, value)


@pytest.mark.parametrize("name", list(margins.FIGURES))
def test_bar_is_the_one_its_test_asserts(name):
    """The table's bar appears as the bar of an assertion in the test it names."""
    fig = margins.FIGURES[name]
    sign = ">=" if fig.higher_is_better else "<="
    text = (ROOT / fig.test).read_text()
    assert re.search(rf"assert .*{sign} {re.escape(str(fig.threshold))}\b", text), (fig.test, sign, fig.threshold)
