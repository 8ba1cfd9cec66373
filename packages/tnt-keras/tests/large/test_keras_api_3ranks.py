"""Every way a Keras user trains (jobs/keras_api.py) on 3 ranks: global batches and last
batches that 3 does not divide, against serial Keras in the same job.

Outside the default suite (3 TensorFlow processes on 2 cores took ~165 s of CI there; the
suite runs the job on 1 and 2 ranks): ``nox -s keras_large``.
"""

from __future__ import annotations

import pytest
from conftest import assert_check, launch
from test_keras_api import CHECKS


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    result = launch(3, "keras_api.py", tmp_path_factory.mktemp("keras_api_3") / "keras_api.json")
    assert result["ranks"] == 3
    return result["checks"]


def test_no_job_step_failed(checks):
    failed = {k: v["detail"] for k, v in checks.items() if k.startswith("job_step_")}
    assert not failed, failed


@pytest.mark.parametrize("name", CHECKS)
def test_check_on_3_ranks(checks, name):
    assert_check(checks, name)
