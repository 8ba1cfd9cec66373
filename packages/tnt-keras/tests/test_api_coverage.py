"""docs/keras.md's "Keras API coverage" table names every public keras.Model method and
every argument of fit/evaluate/predict/compile of the installed Keras, each once."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import keras

DOC = Path(__file__).resolve().parents[3] / "docs" / "keras.md"
STATUSES = {"exact", "rule", "local", "not supported"}
LOOPS = ("fit", "evaluate", "predict", "compile")


def _table() -> dict[str, str]:
    text = DOC.read_text().split("## Keras API coverage", 1)[1]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[1] not in STATUSES:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        owner = names[0] if names and names[0] in LOOPS and len(names) > 1 else None
        for name in names[1:] if owner else names:
            key = f"{owner}.{name}" if owner else name
            assert key not in rows, f"{key} is listed twice"
            rows[key] = cells[1]
    return rows


def _public_methods() -> set[str]:
    return {n for n in dir(keras.Model) if not n.startswith("_")
            and callable(getattr(keras.Model, n))
            and not isinstance(inspect.getattr_static(keras.Model, n), property)}


def test_every_public_method_is_in_the_table():
    rows = _table()
    loops_covered = {k.split(".")[0] for k in rows if "." in k}
    missing = sorted(_public_methods() - set(rows) - loops_covered)
    assert not missing, f"add these keras.Model methods to docs/keras.md's coverage table: {missing}"


def test_every_argument_of_the_loops_is_in_the_table():
    rows = _table()
    missing = []
    for loop in LOOPS:
        for arg in list(inspect.signature(getattr(keras.Model, loop)).parameters)[1:]:
            if f"{loop}.{arg}" not in rows:
                missing.append(f"{loop}.{arg}")
    assert not missing, f"add these arguments to docs/keras.md's coverage table: {missing}"


def test_tnt_model_accepts_every_argument_of_the_loops():
    import tarantella as tnt

    for loop in ("fit", "evaluate", "predict"):
        keras_args = set(list(inspect.signature(getattr(keras.Model, loop)).parameters)[1:])
        tnt_params = inspect.signature(getattr(tnt.Model, loop)).parameters
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in tnt_params.values())
        missing = keras_args - set(tnt_params) - ({"kwargs"} if has_var_kw else set())
        assert not missing, f"tnt.Model.{loop} lacks Keras arguments {sorted(missing)}"
