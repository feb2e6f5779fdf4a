"""Bad command-line input: a one-line error naming the option, a non-zero exit, no
traceback, nothing made or changed, and no coordinator needed (the error comes before
any connection)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import fedra_cli


def one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    """Exit code 2, and stderr is the one line ``fedra: error: <expected>...``."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"fedra: error: {expected}"), line


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound (so nobody else takes it), not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--port", "70000"], "--port: must be from 0 to 65535 (0 picks a free port), got 70000"),
        (["--port", "-1"], "--port: must be from 0 to 65535"),
        (["--heartbeat-s", "nan"], "--heartbeat-s: must be a finite number > 0, got nan"),
        (["--site-timeout-s", "0"], "--site-timeout-s: must be a finite number > 0"),
        (["--workers", "2"], "--workers: must be from 4 to 1024, got 2"),
        (["--db", "notaurl"], "--db: Could not parse SQLAlchemy URL"),
        (["--db", "nosuchdialect://x"], "--db: Can't load plugin"),
    ],
)
def test_coordinator_refuses_bad_flags_before_making_its_state_dir(
    tmp_path: Path, flags: list[str], expected: str
) -> None:
    state = tmp_path / "state"
    result = fedra_cli("coordinator", "--state-dir", str(state), "--insecure", *flags)
    one_line_error(result, expected)
    assert not state.exists()


def test_coordinator_names_db_when_its_database_server_does_not_answer(
    tmp_path: Path, closed_port: int
) -> None:
    pytest.importorskip("psycopg")
    state = tmp_path / "state"
    url = f"postgresql+psycopg://nobody:secret@127.0.0.1:{closed_port}/x"
    result = fedra_cli("coordinator", "--state-dir", str(state), "--insecure", "--db", url)
    one_line_error(result, "--db: (psycopg.OperationalError) ")
    assert str(closed_port) in result.stderr and "secret" not in result.stderr
    assert not state.exists()  # no coordinator.json claiming a daemon, no empty folder


def test_coordinator_names_db_when_an_existing_state_dir_has_an_unreachable_database(
    tmp_path: Path, closed_port: int
) -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://nobody@127.0.0.1:{closed_port}/x"
    result = fedra_cli("coordinator", "--state-dir", str(tmp_path), "--insecure", "--db", url)
    one_line_error(result, "--db: ")
    assert list(tmp_path.iterdir()) == []


def test_coordinator_names_port_when_it_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = fedra_cli(
            "coordinator", "--state-dir", str(tmp_path / "s"), "--insecure", "--port", str(port)
        )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"fedra: error: --port: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert not (tmp_path / "s" / "coordinator.json").exists()


@pytest.mark.parametrize("round_number", ["-1", str(2**32)])
def test_export_refuses_a_round_out_of_range(
    tmp_path: Path, closed_port: int, round_number: str
) -> None:
    out = tmp_path / "model.safetensors"
    result = fedra_cli(
        "run", "export", "r1", "--out", str(out), "--round", round_number,
        "--coordinator", f"127.0.0.1:{closed_port}", "--insecure",
    )  # fmt: skip
    one_line_error(result, f"--round: must be a round number from 0 to {2**32 - 1}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("from_round", ["-1", str(2**32)])
def test_status_refuses_a_from_round_out_of_range(closed_port: int, from_round: str) -> None:
    result = fedra_cli(
        "run", "status", "r1", "--from-round", from_round,
        "--coordinator", f"127.0.0.1:{closed_port}", "--insecure",
    )  # fmt: skip
    one_line_error(result, "--from-round: must be a round number from 0")


def test_export_checks_the_out_directory_before_connecting(
    tmp_path: Path, closed_port: int
) -> None:
    missing = tmp_path / "missing-dir"
    address = f"127.0.0.1:{closed_port}"
    result = fedra_cli(
        "run", "export", "r1", "--out", str(missing / "model.safetensors"),
        "--coordinator", address, "--insecure",
    )  # fmt: skip
    one_line_error(result, f"--out: directory {missing} does not exist")
    assert not missing.exists()
    result = fedra_cli(
        "run", "export", "r1", "--out", str(tmp_path), "--coordinator", address, "--insecure"
    )
    one_line_error(result, f"--out: {tmp_path} is a directory")


@pytest.mark.parametrize(
    ("command", "address"),
    [
        (["run", "list"], "127.0.0.1"),
        (["sites"], "localhost:"),
        (["run", "cancel", "r1"], ":50051"),
        (["run", "watch", "r1"], "host:70000"),
        (["run", "submit", "run.toml"], "h:x"),
    ],
)
def test_admin_commands_need_host_and_port(command: list[str], address: str) -> None:
    result = fedra_cli(*command, "--coordinator", address, "--insecure")
    one_line_error(
        result, f"--coordinator: must be host:port with a port in 1-65535, got {address!r}"
    )


def test_a_run_spec_s_bad_key_is_named_with_its_file(tmp_path: Path, closed_port: int) -> None:
    """A typo in a run spec names the file as well as the key (a submit may be one of
    many files), before anything is dialled."""
    spec = tmp_path / "run.toml"
    spec.write_text('task = "m:t"\nrounds = 2\nsites_per_rond = 2\n')
    address = f"127.0.0.1:{closed_port}"
    result = fedra_cli("run", "submit", str(spec), "--coordinator", address, "--insecure")
    one_line_error(result, f"{spec}: sites_per_rond: unknown key")


def test_an_ipv6_coordinator_needs_brackets(closed_port: int) -> None:
    result = fedra_cli("run", "list", "--coordinator", "::1", "--insecure")
    one_line_error(result, "--coordinator: must be host:port with an IPv6 host in brackets")
    # In brackets it is taken, and dialled (nothing listens there: refused, not misread).
    dialled = fedra_cli("run", "list", "--coordinator", f"[::1]:{closed_port}", "--insecure")
    assert dialled.returncode == 1, dialled.stderr
    assert dialled.stderr.startswith(
        f"fedra: cannot reach the coordinator at [::1]:{closed_port} (--coordinator): "
    )
    assert "must be" not in dialled.stderr


def test_the_coordinator_from_the_environment_is_checked_too() -> None:
    result = fedra_cli("run", "list", "--insecure", env={"FEDRA_COORDINATOR": "127.0.0.1"})
    one_line_error(result, "$FEDRA_COORDINATOR: must be host:port")


def test_a_sites_coordinator_override_is_checked(tmp_path: Path) -> None:
    result = fedra_cli(
        "site", "--config", str(tmp_path / "site.toml"), "--coordinator", "127.0.0.1"
    )
    one_line_error(result, "--coordinator: must be host:port")


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            ['allowed_tasks = ["fedra.examples.digitz:task"]', "insecure = true"],
            "allowed_tasks: cannot import task module 'fedra.examples.digitz'",
        ),
        (
            ['allowed_tasks = ["fedra.examples.synthetic:task"]', 'tls_dir = "{tmp}/nowhere"'],
            "tls_dir: missing TLS file: {tmp}/nowhere/",
        ),
        (  # the path of a file in the folder, not the folder
            ['allowed_tasks = ["fedra.examples.synthetic:task"]', 'tls_dir = "{tmp}/site.toml"'],
            "tls_dir: [Errno 20] Not a directory: '{tmp}/site.toml/",
        ),
    ],
)
def test_a_site_names_its_file_and_key_for_tasks_and_tls(
    tmp_path: Path, lines: list[str], expected: str
) -> None:
    config = tmp_path / "site.toml"
    body = ['site_id = "s1"', 'coordinator = "127.0.0.1:1"', *lines]
    config.write_text("\n".join(line.format(tmp=tmp_path) for line in body) + "\n")
    result = fedra_cli("site", "--config", str(config))
    one_line_error(result, f"{config}: {expected.format(tmp=tmp_path)}")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--sites", "0"], "--sites: must be from 1 to 32"),
        (["--rounds", "0"], "--rounds: must be from 1 to 1000000, got 0"),
        (["--rounds", "-3"], "--rounds: must be from 1"),
        (["--strategy", "fedsgd"], "--strategy: must be one of fedavg, fedavgm"),
        (["--alpha", "0"], "--alpha: must be a number in (0, 1000], got 0.0"),
        (["--alpha", "nan"], "--alpha: must be a number"),
        (["--partition-seed", "-1"], "--partition-seed: must be from 0"),
    ],
)
def test_demo_names_the_flag_and_makes_no_directory(
    tmp_path: Path, flags: list[str], expected: str
) -> None:
    temp = tmp_path / "tmp"  # where the demo's default state directory would go
    temp.mkdir()
    result = fedra_cli("demo", *flags, env={"TMPDIR": str(temp)})
    one_line_error(result, expected)
    assert list(temp.iterdir()) == []
    given = tmp_path / "state"
    result = fedra_cli("demo", "--state-dir", str(given), *flags, env={"TMPDIR": str(temp)})
    one_line_error(result, expected)
    assert not given.exists() and list(temp.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"sites": 33}, "--sites: must be from 1 to 32"),
        ({"rounds": 1_000_001}, "--rounds: must be from 1 to 1000000"),
        ({"state_dir": Path(__file__)}, "--state-dir: "),
    ],
)
def test_demo_options_past_their_limits_name_the_flag(
    options: dict[str, object], expected: str
) -> None:
    """In process: a demo that got past these would start a cluster."""
    from fedra.config import ConfigError
    from fedra.demo import DemoOptions

    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        DemoOptions(**options).validate()  # type: ignore[arg-type]


def test_watch_of_a_coordinator_never_reached_says_it_cannot_reach_it(closed_port: int) -> None:
    address = f"127.0.0.1:{closed_port}"
    result = fedra_cli(
        "run", "watch", "r1", "--coordinator", address, "--insecure", "--reconnect-s", "1"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert all(f"cannot reach the coordinator at {address}" in line for line in lines), lines
    assert "lost" not in result.stderr
    assert lines[-1].endswith("giving up")


def test_watch_gives_up_on_a_coordinator_it_never_reached_within_seconds(
    closed_port: int,
) -> None:
    """A mistyped address is not a coordinator restart: no 300 s of retries."""
    address = f"127.0.0.1:{closed_port}"
    started = time.monotonic()
    result = fedra_cli("run", "watch", "r1", "--coordinator", address, "--insecure", timeout_s=60)
    assert time.monotonic() - started < 40  # not the default --reconnect-s of 300
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"run watch: cannot reach the coordinator at {address} after 10 s (")
    assert last.endswith("giving up"), last


def test_watch_waits_its_whole_time_for_a_state_dir_whose_daemon_is_starting(
    tmp_path: Path,
) -> None:
    """No coordinator.json yet is a daemon still starting (it may be resuming big runs),
    not a typo: the watch waits all of --reconnect-s for it."""
    result = fedra_cli(
        "run", "watch", "r1", "--state-dir", str(tmp_path), "--insecure", "--reconnect-s", "11"
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "coordinator.json: not found" in last and "after 11 s" in last, last


@pytest.mark.parametrize(
    ("env", "flags", "source"),
    [
        ({}, ["--coordinator", "{address}"], "(--coordinator)"),
        ({"FEDRA_COORDINATOR": "{address}"}, [], "($FEDRA_COORDINATOR)"),
    ],
)
def test_an_admin_command_says_which_coordinator_it_cannot_reach(
    closed_port: int, env: dict[str, str], flags: list[str], source: str
) -> None:
    address = f"127.0.0.1:{closed_port}"
    flags = [f.format(address=address) for f in flags]
    env = {k: v.format(address=address) for k, v in env.items()}
    result = fedra_cli("sites", *flags, "--insecure", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"fedra: cannot reach the coordinator at {address} {source}: "), line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--target", "127.0.0.1"], "--target: must be host:port"),
        (["--target", "127.0.0.1:1", "--listen", "h:port"], "--listen: must be host:port"),
    ],
)
def test_wan_checks_its_addresses(flags: list[str], expected: str) -> None:
    result = fedra_cli("wan", "--bandwidth-mbit", "1", *flags)
    one_line_error(result, expected)


def test_coordinator_names_a_database_a_newer_fedra_wrote(tmp_path: Path) -> None:
    from sqlalchemy import text

    from fedra.storage import Store

    state = tmp_path / "state"
    state.mkdir()
    store = Store(f"sqlite:///{state / 'fedra.db'}")
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    store.close()
    result = fedra_cli("coordinator", "--state-dir", str(state), "--insecure", "--port", "0")
    one_line_error(result, "--state-dir: database sqlite:///")
    assert "'9999_future' is newer than this fedra understands" in result.stderr
    assert not (state / "coordinator.json").exists()


def test_every_command_s_help_shows_its_defaults() -> None:
    import argparse

    from fedra.cli import build_parser

    def parsers(
        parser: argparse.ArgumentParser, name: str
    ) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(name, parser)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    found += parsers(child, f"{name} {sub}")
        return found

    missing = []
    for name, parser in parsers(build_parser(), "fedra"):
        formatter = parser._get_formatter()
        for action in parser._actions:
            shown = action.default not in (None, False, "", [], argparse.SUPPRESS)
            if not action.option_strings or not shown or action.help == argparse.SUPPRESS:
                continue
            # What --help prints for it (argparse prints nothing for an option without help).
            printed = formatter._get_help_string(action) if action.help else ""
            if "default" not in printed:
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, f"--help does not show these defaults: {missing}"
    help_text = build_parser().format_help()
    assert "(default: text)" in help_text or "$FEDRA_LOG_FORMAT or text" in help_text


def test_an_open_round_s_progress_counts_its_current_attempt() -> None:
    from fedra.cli import format_open_round
    from fedra.protos.v1 import admin_pb2

    r = admin_pb2.RoundStatus(
        number=4,
        attempt=2,
        status="open",
        sampled_sites=["a", "b", "c", "d"],
        opened_unix_s=100.0,
        bytes_down=2_000_000,
        participations=[
            admin_pb2.Participation(site_id="a", attempt=1, status="failed"),  # the last try
            admin_pb2.Participation(site_id="a", attempt=2, status="accepted"),
            admin_pb2.Participation(site_id="b", attempt=2, status="downloaded"),
            admin_pb2.Participation(site_id="c", attempt=2, status="assigned"),
            admin_pb2.Participation(site_id="d", attempt=2, status="failed"),
        ],
    )
    counts, clock = format_open_round(r, now=112.4)
    assert counts == (
        "open round 4 (attempt 2): 1/4 updates in, 1 training or uploading, 1 yet to start, "
        "1 failed, 2.000 MB moved"
    )
    assert clock == "12 s so far (0.16 MB/s)"
    assert format_open_round(r, now=100.5)[1] == "0 s so far"  # no rate from half a second
    # The same round as a summary (what `run watch` asks for): counts, no rows.
    summary = admin_pb2.RoundStatus()
    summary.CopyFrom(r)
    summary.ClearField("participations")
    summary.ClearField("sampled_sites")
    summary.sampled_count = 4
    summary.participation_counts.update(accepted=1, downloaded=1, assigned=1, failed=1)
    assert format_open_round(summary, now=112.4) == (counts, clock)


def test_the_progress_bar() -> None:
    from fedra.cli import progress_bar

    assert progress_bar(0, 40, 10) == "[----------]  0/40"
    assert progress_bar(12, 40, 10) == "[###-------] 12/40"
    assert progress_bar(40, 40, 10) == "[##########] 40/40"
    assert progress_bar(0, 0, 4) == "[----] 0/0"


def test_watch_at_a_terminal_rewrites_one_line_with_a_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedra import cli
    from fedra.protos.v1 import admin_pb2

    progress = cli._Progress()
    progress.live = True
    parts = [admin_pb2.Participation(site_id="a", attempt=1, status="accepted")]
    r = admin_pb2.RoundStatus(
        number=2, attempt=1, status="open", sampled_sites=["a", "b"], participations=parts
    )
    progress.update(r)
    progress.end()
    out = capsys.readouterr().out
    assert out.startswith("\r[" + "#" * 12 + "-" * 12 + "] 1/2 open round 2: 1/2 updates in")
    assert out.endswith("\r\033[K")  # the line is cleared before anything else prints


def test_watch_says_how_long_a_run_has_waited_for_sites(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedra import cli

    clock = [1000.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    progress = cli._Progress()
    progress.live = False
    why = "round 3: waiting for online sites serving t: 1 eligible, want 3 (quorum 2)"
    for waited in range(0, 12):  # the coordinator's reason changes every second
        progress.waiting(f"{why}, for {waited} s so far")
        clock[0] += 1.0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"next {why}, for 0 s so far"]  # same words: not again, whatever the clock
    more = why.replace("1 eligible", "2 eligible")
    progress.waiting(f"{more}, for 12 s so far")
    assert capsys.readouterr().out == f"next {more}, for 12 s so far\n"


def test_watch_s_plain_progress_lines_come_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedra import cli
    from fedra.protos.v1 import admin_pb2

    clock = [1000.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    progress = cli._Progress()
    progress.live = False  # a log file, not a terminal

    def round_with(accepted: int) -> admin_pb2.RoundStatus:
        parts = [admin_pb2.Participation(site_id=f"s{i}", attempt=1, status="accepted")
                 for i in range(accepted)]  # fmt: skip
        return admin_pb2.RoundStatus(number=1, attempt=1, status="open",
                                     sampled_sites=["x"] * 9, participations=parts)  # fmt: skip

    for accepted in range(5):  # five changes within a second: one line
        progress.update(round_with(accepted))
        clock[0] += 0.2
    clock[0] += cli._Progress.PLAIN_EVERY_S
    progress.update(round_with(5))  # a while later: the next
    progress.update(round_with(5))  # unchanged: nothing
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split("/")[0].strip() for line in lines] == ["0", "5"], lines
