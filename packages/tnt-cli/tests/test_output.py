"""The filter between the MPI starter's stderr and the user (fed recorded lines)."""

from __future__ import annotations

import io

from tnt_cli.output import StarterOutput
from tnt_cli.rank import worth_showing

BANNER = [
    b"--------------------------------------------------------------------------\n",
    b"MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n",
    b"  Errorcode: 1\n",
    b"--------------------------------------------------------------------------\n",
]
TRACEBACK = [
    b"Traceback (most recent call last):\n",
    b'  File "train.py", line 3, in <module>\n',
    b"    load()\n",
    b"tarantella._inputs.InputError: the dataset has no batch size\n",
]


def shown(lines: list[bytes], verbose: bool = False) -> tuple[str, StarterOutput]:
    sink = io.BytesIO()
    output = StarterOutput(sink, verbose=verbose)
    output.consume(lines)
    return sink.getvalue().decode(), output


def test_a_traceback_printed_by_several_ranks_is_shown_once() -> None:
    header = b"[1] tarantella: rank 1 failed with exit code 1; the end of its stderr:\n"
    text, output = shown([*TRACEBACK, header, *(b"[1] " + line for line in TRACEBACK)])
    assert text.count("InputError: the dataset has no batch size") == 2  # once + the note
    assert text.endswith("[1] (the same traceback as shown above: "
                         "tarantella._inputs.InputError: the dataset has no batch size)\n")
    assert output.rank_error_shown


def test_different_tracebacks_are_all_shown() -> None:
    other = [*TRACEBACK[:-1], b"ValueError: something else\n"]
    text, _ = shown([*TRACEBACK, *(b"[2] " + line for line in other)])
    assert "InputError" in text and "[2] ValueError: something else" in text


def test_banner_hidden_inside_a_traceback_and_nul_removed() -> None:
    """Open MPI's banner arriving in the middle of rank 0's traceback, then a NUL."""
    lines = [*TRACEBACK[:2], *BANNER, *TRACEBACK[2:],
             b"\0[1] tarantella: rank 1 failed with exit code 1; the end of its stderr:\n"]
    text, output = shown(lines)
    assert text == b"".join(TRACEBACK).decode() + (
        "[1] tarantella: rank 1 failed with exit code 1; the end of its stderr:\n")
    assert output.hidden_count == 1
    assert output.failure == "MPI_ABORT was invoked on rank 1"


def test_verbose_shows_banners() -> None:
    text, output = shown(BANNER, verbose=True)
    assert text == b"".join(BANNER).decode() and output.hidden_count == 0


def test_failure_seen_although_no_rank_error_is_shown_then_explained() -> None:
    """A lost host: Open MPI may end with exit code 0; the banner is the only cause."""
    lost = [BANNER[0], b"A daemon failed to report back after being spawned.\n", BANNER[0],
            b"[host1:00000] *** An error occurred in Socket closed\n",
            b"[host1:25303] plm:ssh: Warning: setpgid(25306,25306) failed in parent\n"]
    text, output = shown(lost)
    assert text == "" and output.hidden_count == 3
    assert output.failure == "the MPI daemon of another host ended or could not be reached"
    assert not output.rank_error_shown
    sink = output.sink
    output.explain()  # no rank error on screen: the hidden messages are the explanation
    assert b"A daemon failed to report back" in sink.getvalue()  # type: ignore[attr-defined]


def test_user_dashes_are_not_taken_for_a_banner() -> None:
    table = [b"-" * 60 + b"\n", b"epoch 3: accuracy 0.91\n", b"-" * 60 + b"\n"]
    text, output = shown(table)
    assert text == b"".join(table).decode() and output.hidden_count == 0
    unclosed = [b"-" * 74 + b"\n", *(f"row {i}\n".encode() for i in range(100))]
    text, output = shown(unclosed)
    assert text.count("row ") == 100 and output.hidden_count == 0


def test_failing_rank_report_starts_at_its_traceback() -> None:
    noise = [b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
             b"I0000 00:00:1795424762.882742   15895 cudart_stub.cc:31] Could not find cuda drivers\n",
             b"E0000 00:00:1795424787.444074   15893 cuda_platform.cc:52] failed call to cuInit: "
             b"INTERNAL: CUDA error\n"]
    assert worth_showing([*noise, *TRACEBACK]) == TRACEBACK
    assert worth_showing([*noise, b"Killed\n"]) == [b"Killed\n"]


def test_other_errors_are_not_noise() -> None:
    line = b"E0000 00:00:1.5   42 op_kernel.cc:1830] OP_REQUIRES failed: OOM\n"
    assert worth_showing([line]) == [line]


def test_a_programs_own_words_are_no_sign_of_failure() -> None:
    _, output = shown([b"lost connection to the database, retrying\n",
                       b"*** An error occurred in my parser (recovered)\n",
                       b"[0] peer has unexpectedly disconnected\n"])
    assert output.failure is None and output.failure_at is None
