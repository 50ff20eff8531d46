"""Audit BI: `kvtier check` refuses an empty path (exit 2, one line naming it) rather than
checking, and fixing, the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main


def test_check_of_an_empty_path_is_refused_not_the_working_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvtier check "$DISK" --fix` with DISK unset checked (and fixed) the working directory:
    `Path("")` is `.`."""
    monkeypatch.chdir(tmp_path)
    assert main(["check", "", "--fix"]) == 2
    err = capsys.readouterr().err
    assert "config field 'PATH': got ''" in err and "empty path" in err
    assert list(tmp_path.iterdir()) == []  # nothing made (no lock file) in the working directory
