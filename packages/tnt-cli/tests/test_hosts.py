"""Hostfile parsing and placement of ranks on hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tnt_cli.errors import UsageError
from tnt_cli.hosts import (
    Host,
    is_oversubscribed_locally,
    parse_hostfile_text,
    place_ranks,
    read_hostfile,
)


def test_plain_and_slots_lines_comments_and_blanks() -> None:
    text = "# cluster\nnode1\n\nnode2 slots=4   # big one\n  node3  slots=2\n"
    assert parse_hostfile_text(text) == [Host("node1"), Host("node2", 4), Host("node3", 2)]


def test_mpich_colon_form() -> None:
    assert parse_hostfile_text("a:4\nb\n") == [Host("a", 4), Host("b")]
    with pytest.raises(UsageError, match="slots must be a positive integer, got 0"):
        parse_hostfile_text("a:0\n")


def test_max_slots_is_accepted_and_ignored() -> None:
    assert parse_hostfile_text("a slots=2 max_slots=8\n") == [Host("a", 2)]


def test_duplicate_host_names_both_lines() -> None:
    with pytest.raises(UsageError, match=r"hosts:3: host 'a' is listed twice \(first on line 1\)"):
        parse_hostfile_text("a\nb\na slots=2\n", source="hosts")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("a slots=0", "slots must be a positive integer"),
        ("a slots=x", "slots must be a positive integer"),
        ("a cores=4", "cannot read 'cores=4'"),
        ("a slots", "cannot read 'slots'"),
        ("a/b", "is not a host name"),
        ("a:b", "is not a host name"),
    ],
)
def test_bad_lines_name_the_line(line: str, message: str) -> None:
    with pytest.raises(UsageError, match=rf"hostfile:1: .*{message}"):
        parse_hostfile_text(line + "\n")


def test_empty_hostfile_is_an_error() -> None:
    with pytest.raises(UsageError, match="no hosts listed"):
        parse_hostfile_text("# nothing\n\n")


def test_unreadable_hostfile(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"cannot read hostfile .*missing.*No such file"):
        read_hostfile(tmp_path / "missing")
    with pytest.raises(UsageError, match=r"cannot read hostfile .*Is a directory"):
        read_hostfile(tmp_path)


def test_read_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("x slots=2\ny\n")
    assert read_hostfile(path) == [Host("x", 2), Host("y")]


HOSTS3 = [Host("a"), Host("b"), Host("c")]
SLOTTED = [Host("a", 2), Host("b", 1)]


@pytest.mark.parametrize(
    ("hosts", "n", "k", "gpus", "expected"),
    [
        (None, 4, None, 0, (("localhost", 4),)),
        (None, None, 3, 0, (("localhost", 3),)),
        (None, None, None, 2, (("localhost", 2),)),  # one rank per GPU
        (HOSTS3, None, 2, 0, (("a", 2), ("b", 2), ("c", 2))),
        (HOSTS3, 6, 2, 0, (("a", 2), ("b", 2), ("c", 2))),
        (HOSTS3, 4, None, 0, (("a", 2), ("b", 1), ("c", 1))),  # spread, first get more
        (HOSTS3, 2, None, 0, (("a", 1), ("b", 1))),  # hosts with none are dropped
        (HOSTS3, None, None, 4, (("a", 4), ("b", 4), ("c", 4))),
        (SLOTTED, 3, None, 0, (("a", 2), ("b", 1))),  # fill slots in order
        (SLOTTED, 2, None, 0, (("a", 2),)),
        (SLOTTED, 5, None, 0, (("a", 3), ("b", 2))),  # rest round-robin
        (SLOTTED, None, None, 0, (("a", 2), ("b", 1))),  # no -n: slots
    ],
)
def test_place_ranks(hosts, n, k, gpus, expected) -> None:
    placement = place_ranks(hosts, n, k, gpus_per_node=gpus, cores=64)
    assert placement.counts == expected
    assert placement.local is (hosts is None)
    assert placement.total == sum(c for _, c in expected)


def test_no_n_no_gpu_one_per_host_with_warning() -> None:
    placement = place_ranks(HOSTS3, None, None, cores=64)
    assert placement.counts == (("a", 1), ("b", 1), ("c", 1))
    assert len(placement.warnings) == 1
    assert "one process per host" in placement.warnings[0]
    local = place_ranks(None, None, None, cores=64)
    assert local.counts == (("localhost", 1),) and local.warnings


def test_n_and_n_per_node_must_agree() -> None:
    with pytest.raises(UsageError, match=r"-n 5 conflicts with --n-per-node 2 on 3 host\(s\)"):
        place_ranks(HOSTS3, 5, 2)
    with pytest.raises(UsageError, match=r"-n 2 conflicts with --n-per-node 3 on 1 host"):
        place_ranks(None, 2, 3)


def test_oversubscription_note_local() -> None:
    placement = place_ranks(None, 3, None, cores=2)
    assert placement.notes == ("3 processes on 2 core(s): oversubscribing; "
                               "expect each process to run slower",)
    assert is_oversubscribed_locally(placement, cores=2)
    fits = place_ranks(None, 2, None, cores=2)
    assert fits.notes == () and not is_oversubscribed_locally(fits, cores=2)


def test_oversubscription_note_per_host_slots() -> None:
    placement = place_ranks(SLOTTED, 5, None, cores=1)
    assert placement.notes == (
        "3 processes on a with slots=2: oversubscribing",
        "2 processes on b with slots=1: oversubscribing",
    )
    assert not is_oversubscribed_locally(placement, cores=1)  # mpirun gets exact counts


def test_uniform() -> None:
    assert place_ranks(HOSTS3, None, 2).uniform == 2
    assert place_ranks(HOSTS3, 4, None).uniform is None
