"""Per-rank memory on 2 ranks (issue 29; jobs/memory.py, docs/memory.md): the measured peak
of TENSOR, PIPELINING and DATA stays within a bound derived from ``memory_report()``'s
estimate, the estimate's parameter bytes add up to the serial model's (counted from its
shapes in the job, not by the code under test), and ``memory_budget=`` fails on every rank
before training, with the per-rank figures and the fix.
"""

from __future__ import annotations

import pytest
from conftest import launch

MIB = 2**20
#: What a rank holds beyond the counted state while training: TensorFlow's traced step
#: functions, oneDNN's caches, Keras' loop, the tnt_comm buffers of small messages
#: (measured 27-57 MiB above the estimate here before the estimate counted the update's
#: temporaries; before issue 29's cuts DATA's replica sync alone added 3 x 168 MiB).
RUNTIME_BYTES = 128 * MIB
#: How far above its estimate a peak may go (allocator fragmentation, temporaries).
SLACK = 1.25
#: DATA's own, tighter bound: at most one gradient set of buckets plus this above its
#: estimate. The wait op's outputs borrow the engine's buckets (Note [Wait outputs borrow
#: the buckets], tnt_tf_ops.cc); when it copied them, a second gradient set (56 MiB here)
#: stood beside the buckets during the update. Measured with this job on 2 ranks of the
#: 2-core machine (same hour), against the estimate with one bucket set (then counted in
#: it): copying 49-59 MiB above, borrowing 22-35 MiB (two runs). The estimate no longer
#: counts the buckets (transient, waited one at a time: docs/memory.md, "Buckets one at a
#: time"), so the bound adds the gradient set back: the same bound as before. Measured
#: since then: 55-64 MiB above the estimate without buckets, i.e. -1 to 8 above the old one
#: (this model's kernels are under the fusion threshold, so most buckets still launch in
#: plan order; the issue's MLP gains a full set). 44 MiB fails the copy; SLACK's bound
#: (1.25 x estimate + 128 MiB) passes it.
DATA_ABOVE_ESTIMATE = 44 * MIB
STRATEGIES = ("TENSOR", "PIPELINING", "DATA")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    res = launch(2, "memory.py", out)
    assert res["ranks"] == 2
    print(f"\nper-rank memory, MiB (serial state {res['serial_state_bytes'] / MIB:.0f})")
    for s, recs in res["strategies"].items():
        for k, r in enumerate(recs):
            cats = ", ".join(f"{c} {v / MIB:.1f}" for c, v in r["estimate"].items() if v)
            print(f"{s:10} rank {k}: estimate {r['estimate_total'] / MIB:7.1f}  measured peak "
                  f"{r['peak'] / MIB:7.1f} (reset {r['hwm_reset']})  [{cats}]")
    return res


def test_model_is_large_enough_for_the_bound_to_mean_something(result):
    assert result["serial_state_bytes"] >= 200e6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_peak_within_bound_of_estimate(result, strategy):
    for k, r in enumerate(result["strategies"][strategy]):
        bound = SLACK * r["estimate_total"] + RUNTIME_BYTES
        assert 0 < r["peak"] <= bound, (strategy, k, r["peak"] / MIB, bound / MIB, r)
        assert r["report_peak"] > 0, r


def test_data_peak_holds_one_gradient_set_of_buckets(result):
    for k, r in enumerate(result["strategies"]["DATA"]):
        assert r["estimate"]["communication_buffers"] == 0, r["estimate"]
        # at most one set of buckets; measured before the estimate counted the update's
        # temporaries (so they are left out here: the bound stays as strict as it was)
        counted = r["estimate_total"] - r["estimate"]["update_temporaries"]
        above = r["peak"] - counted - r["estimate"]["gradients"]
        assert above <= DATA_ABOVE_ESTIMATE, (k, above / MIB, r["peak"] / MIB, r["estimate_total"] / MIB)


def test_parameters_add_up_to_the_serial_model(result):
    serial_params = result["serial_state_bytes"] // 4
    st = result["strategies"]
    assert all(r["estimate"]["parameters"] == serial_params for r in st["DATA"])
    assert sum(r["estimate"]["parameters"] for r in st["PIPELINING"]) == serial_params
    # TENSOR: the split layers' halves, the small replicated head on both ranks
    tensor = [r["estimate"]["parameters"] for r in st["TENSOR"]]
    assert serial_params <= sum(tensor) <= 1.01 * serial_params, tensor
    for s in STRATEGIES:
        for r in st[s]:
            e = r["estimate"]
            # Adam: 2 slots per weight, and its iteration count and learning rate (a few bytes)
            assert 0 <= e["optimizer_slots"] - 2 * e["gradients"] <= 64, (s, e)
    # Transient buckets waited one at a time (the default) carry the gradients instead of
    # standing beside them: no set of their own (docs/memory.md, "Buckets one at a time").
    assert all(r["estimate"]["communication_buffers"] == 0 for r in st["DATA"])
    # The micro-batches' sum is the step's gradient set (summed in place, Note [Gradients
    # summed in place]): no accumulator beside it.
    assert all(r["estimate"]["gradient_accumulators"] == 0 for r in st["PIPELINING"])
    # The update's temporaries: 2 copies of the rank's largest variable, a 2048 x 2048 float32
    # kernel on every DATA rank and pipeline stage, half of one on a tensor shard.
    kernel = 2048 * 2048 * 4
    assert all(r["estimate"]["update_temporaries"] == 2 * kernel for s in ("DATA", "PIPELINING") for r in st[s])
    assert all(r["estimate"]["update_temporaries"] == kernel for r in st["TENSOR"]), st["TENSOR"]
    # The larger stage holds 57 % of the parameters at DATA's 16 bytes per parameter, plus
    # its few activations: 0.57 of DATA's estimate (0.72 while it counted an accumulator,
    # +25 % of 16 bytes; this bound was 0.75).
    # (The update's temporaries, the same on both, are left out of this share.)
    def state(r: dict) -> int:
        return r["estimate_total"] - r["estimate"]["update_temporaries"]

    assert max(state(r) for r in st["PIPELINING"]) < 0.6 * state(st["DATA"][0])


def test_budget_below_the_estimate_fails_on_every_rank_before_training(result):
    tight = result["budget"]["tight"]
    assert len(tight) == 2
    for r in tight:
        assert r["raised"], r
        assert "rank 0:" in r["message"] and "rank 1:" in r["message"], r["message"]
        assert "more pipeline stages" in r["message"] and "tensor group" in r["message"], r["message"]
        assert r["weights_unchanged"], r


def test_generous_budget_trains_and_bad_budget_is_a_clear_error(result):
    assert not any(r["raised"] for r in result["budget"]["generous"]), result["budget"]["generous"]
    for r in result["budget"]["unparsable"]:
        assert r["raised"] and "6GiB" in r["message"], r


def test_budget_sizes_parse_with_units():
    from tarantella._core.memory import parse_bytes

    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes(1024) == 1024
    assert parse_bytes(None) is None
    for bad in ("-1GiB", "6 gigs", "GiB", 0, True):
        with pytest.raises(ValueError, match="6GiB"):
            parse_bytes(bad)
