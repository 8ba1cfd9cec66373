"""tools/model_matrix/run.py regenerates selected rows of docs/models.md: the cells measured
are merged into the earlier results, every other row and cell kept (no launch here)."""

from __future__ import annotations

import importlib.util

import pytest
from launch import ROOT

_SPEC = importlib.util.spec_from_file_location("model_matrix_run", ROOT / "tools" / "model_matrix" / "run.py")
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)

KNOWN = ["GPT2Backbone + head", "LlamaBackbone + head", "GemmaBackbone + head", "MobileNetV3Small"]


def test_models_are_picked_by_a_part_of_their_name_in_table_order():
    assert run.select(["mobilenet,llama", "Gemma"], KNOWN, "model") == KNOWN[1:]
    assert run.select(["GPT2Backbone + head"], KNOWN, "model") == KNOWN[:1]


def test_a_name_that_picks_nothing_names_the_known_ones():
    with pytest.raises(SystemExit, match="no model matches 'resnet'; known: GPT2Backbone"):
        run.select(["llama,resnet"], KNOWN, "model")


def test_measured_cells_replace_theirs_and_the_other_rows_and_cells_stay():
    old = {"GPT2Backbone + head": {"DATA": "g-data", "TENSOR": "g-tensor"},
           "LlamaBackbone + head": {"DATA": "l-data", "TENSOR": "l-tensor-old"},
           "Retired model": {"DATA": "r-data"}}
    new = {"LlamaBackbone + head": {"TENSOR": "l-tensor"}, "GemmaBackbone + head": {"TENSOR": "ge", "DATA": "gd"}}
    table = run.merged(old, new, KNOWN, ["DATA", "PIPELINING", "TENSOR"])
    assert list(table) == ["GPT2Backbone + head", "LlamaBackbone + head", "GemmaBackbone + head", "Retired model"]
    assert table["GPT2Backbone + head"] == old["GPT2Backbone + head"]
    assert table["LlamaBackbone + head"] == {"DATA": "l-data", "TENSOR": "l-tensor"}
    assert list(table["GemmaBackbone + head"]) == ["DATA", "TENSOR"]  # strategy order, not measuring order
    assert table["Retired model"] == {"DATA": "r-data"}


def test_a_row_missing_a_cell_is_written_as_not_measured():
    cell = {"status": "ran", "history_diff": 0.0, "history_keys_equal": True, "weight_count": [2, 2],
            "weight_diff": 1e-7, "predict_diff": 0.0, "saved_predict_diff": 0.0, "seconds": 9}
    page = run.write_page({"A": {"DATA": cell}, "B": {"TENSOR": cell}}, ["DATA", "TENSOR"], {"DATA": 2, "TENSOR": 2})
    assert "| A | exact (1e-07) | not measured |" in page
    assert "| B | not measured | exact (1e-07) |" in page
