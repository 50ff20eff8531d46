"""The README's runnable example runs as written, and its two commands stay at the top."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert (
        "StoreResult(cached_tokens=8, stored_tokens=8, dropped_tokens=0, pending_tokens=0)" in out
    )
    assert "'blocks': 2" in out


def test_readme_starts_with_run_and_test_commands() -> None:
    text = README.read_text()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None
    commands = [line for line in first.group(1).splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].endswith("kvtier serve") and commands[1].endswith("pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    after_venv = commands[1].split(" && ", 2)[2]
    assert after_venv == "pip install torch==2.13.0 -e '.[test]' && pytest"
    assert after_venv in ci, ".ci/run must run the README's test command"
