"""The command line's handling of user mistakes: one line on stderr and exit status 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from twophase.cli import main
from twophase.models import minilm

needs_model = pytest.mark.skipif(minilm.model_dir() is None, reason="model package not installed")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["relu", "--seed", "-1"], "--seed"),
        (["relu", "--dtypes", "float32,"], "an empty one"),
        (["relu", "--dtypes", ""], "an empty one"),
    ],
)
def test_check_refuses_a_negative_seed_and_empty_dtype_names(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("twophase check: ") and words in err


def test_python_dash_m_twophase_runs_the_command_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "twophase", "check", "--seed", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and "twophase check: " in r.stderr and "Traceback" not in r.stderr


@needs_model
@pytest.mark.parametrize("trace", ["dir", "missing/t.json", "/dev/full"])
def test_embed_refuses_a_trace_path_it_cannot_write_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    """/dev/full opens but takes no byte: refused only after the run before (the path was only opened)."""
    if trace == "/dev/full" and not Path(trace).exists():
        pytest.skip("no /dev/full here")
    path = tmp_path if trace == "dir" else Path(trace) if trace.startswith("/") else tmp_path / trace
    assert main(["embed", "hello", "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("twophase embed: ") and "cosine" not in captured.out  # nothing was run


@needs_model
def test_embed_refuses_an_empty_trace_name_and_text_that_is_not_unicode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["embed", "hello", "--trace", ""])
    assert e.value.code == 2 and "--trace needs a file name" in capsys.readouterr().err
    assert main(["embed", "caf\udce9", "ok"]) == 2  # Latin-1 bytes in argv reach Python as a lone surrogate
    err = capsys.readouterr().err
    assert "sentences[0]" in err and "Unicode" in err


@needs_model
def test_embed_escapes_text_the_console_cannot_encode() -> None:
    """An ASCII console and a CJK sentence: a UnicodeEncodeError traceback after the run, now escaped text."""
    import os

    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run(
        [sys.executable, "-m", "twophase", "embed", "\u4e2d\u6587", "hello"],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "\\u4e2d" in r.stdout and "cosine" in r.stdout
