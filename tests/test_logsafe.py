"""fedra.logsafe: remote text in a log line is one line, escaped, and bounded."""

from __future__ import annotations

import logging

import pytest

from fedra import logsafe


def test_plain_short_text_is_unchanged() -> None:
    assert logsafe.safe("site-a: no task 'abc'") == "site-a: no task 'abc'"
    assert logsafe.safe("ünïcödé ok") == "ünïcödé ok"
    assert logsafe.safe(ValueError("boom")) == "boom"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\nINFO forged", "a\\nINFO forged"),
        ("a\r\nb", "a\\r\\nb"),
        ("\x1b[2J", "\\x1b[2J"),
        ("tab\there", "tab\\there"),
        ("\u202eevil", "\\u202eevil"),
        ("line\u2028sep", "line\\u2028sep"),
        ("nul\x00", "nul\\x00"),
    ],
)
def test_control_characters_are_escaped(text: str, expected: str) -> None:
    assert logsafe.safe(text) == expected


def test_long_text_is_cut_with_its_original_length() -> None:
    out = logsafe.safe("x" * 2**20)
    assert out == "x" * logsafe.LOG_CHARS + f"... ({2**20} characters)"
    assert logsafe.safe("y" * 50, limit=10) == "y" * 10 + "... (50 characters)"
    assert logsafe.safe("z" * 10, limit=10) == "z" * 10


def test_escapes_count_towards_the_limit_and_are_never_split() -> None:
    out = logsafe.safe("\n" * 1000, limit=7)
    assert out == "\\n" * 3 + "... (1000 characters)"


def test_a_traceback_keeps_its_frames_and_escapes_its_messages() -> None:
    def fail() -> None:
        try:
            raise RuntimeError("inner\nforged")
        except RuntimeError as exc:
            raise ValueError("outer " + "o" * 5000) from exc

    with pytest.raises(ValueError) as info:
        fail()
    text = logsafe.exception_text(info.value)
    assert "in fail" in text and "raise ValueError" in text  # frames are kept
    assert "ValueError: outer " in text and "(5006 characters)" in text
    assert "RuntimeError: inner\\nforged" in text
    assert all(len(line) < 600 for line in text.splitlines())
    assert not any(line.startswith("forged") for line in text.splitlines())


def test_a_record_of_a_safe_value_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        logging.getLogger("fedra.test").info("reason: %s", logsafe.safe("a\nb" * 1000))
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and len(record.getMessage()) < 300
