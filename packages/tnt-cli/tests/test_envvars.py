"""`-x` parsing, TNT_* settings and pass-through of the caller's variables."""

from __future__ import annotations

import pytest

from tnt_cli.envvars import Settings, parse_export, parse_exports, rank_environment
from tnt_cli.errors import UsageError


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("A=1", ("A", "1")),
        ("A=", ("A", "")),
        ("A=x y", ("A", "x y")),
        ("A=b=c", ("A", "b=c")),
        ("_A9=  lead", ("_A9", "  lead")),
        ("PATHS=a:b,c;d", ("PATHS", "a:b,c;d")),
    ],
)
def test_export_forms(item: str, expected: tuple[str, str]) -> None:
    assert parse_export(item) == expected


def test_export_without_value_is_an_error_naming_the_fix() -> None:
    with pytest.raises(UsageError, match=r"-x A: a value is required; write -x A=VALUE"):
        parse_export("A")


@pytest.mark.parametrize("item", ["1A=2", "=x", "A-B=1", "A B=1"])
def test_export_with_bad_name_is_an_error(item: str) -> None:
    with pytest.raises(UsageError, match="not a valid environment variable name"):
        parse_export(item)


def test_several_exports_keep_order_and_last_wins() -> None:
    exports = parse_exports(["B=1", "A=x y", "C=", "B=2"])
    assert list(exports.items()) == [("A", "x y"), ("C", ""), ("B", "2")]


def test_settings_become_tnt_variables() -> None:
    settings = Settings(log_level="DEBUG", log_on_all_devices=True, output_on_all_devices=True,
                        fusion_threshold_kb=64, no_gpu=True)
    assert settings.as_env() == {
        "TNT_FUSION_THRESHOLD": "64",
        "TNT_LOG_LEVEL": "DEBUG",
        "TNT_LOG_ON_ALL_DEVICES": "1",
        "TNT_OUTPUT_ON_ALL_DEVICES": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def test_unset_options_set_nothing() -> None:
    assert Settings().as_env() == {}


def test_fusion_threshold_zero_is_passed() -> None:
    assert Settings(fusion_threshold_kb=0).as_env() == {"TNT_FUSION_THRESHOLD": "0"}


def test_rank_environment_order_pass_through_then_settings_then_exports() -> None:
    caller = {"HOME": "/h", "TF_CPP_MIN_LOG_LEVEL": "2", "TNT_COMM_TIMEOUT": "9",
              "TNT_LOG_LEVEL": "ERROR", "PATH": "/bin"}
    env = rank_environment(Settings(log_level="INFO"), {"Z": "1", "A": "2"}, caller)
    assert list(env.items()) == [
        ("TF_CPP_MIN_LOG_LEVEL", "2"),
        ("TNT_COMM_TIMEOUT", "9"),
        ("TNT_LOG_LEVEL", "INFO"),  # the option overrides the caller's variable
        ("Z", "1"),
        ("A", "2"),
    ]


def test_export_may_override_a_passed_through_variable() -> None:
    env = rank_environment(Settings(), {"TF_X": "new"}, {"TF_X": "old"})
    assert env == {"TF_X": "new"}


def test_export_conflicting_with_an_option_is_refused() -> None:
    with pytest.raises(UsageError, match=r"-x TNT_FUSION_THRESHOLD=\.\.\. conflicts"):
        rank_environment(Settings(fusion_threshold_kb=8), {"TNT_FUSION_THRESHOLD": "1"}, {})
