"""The run-time settings: every setter refuses a bad value with a ParamError naming it and leaves the setting as it
was; every ``TWOPHASE_*`` variable goes through its setter's validator, and a bad one stops ``import twophase``
with a ParamError naming the variable, its value and what is accepted."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import twophase
from twophase import ParamError, config

_SETTERS: dict[str, Callable[[Any], None]] = {
    "launch_blocking": twophase.set_launch_blocking,
    "cache_limit": twophase.set_cache_limit,
    "cache_enabled": twophase.set_cache_enabled,
    "deterministic": twophase.set_deterministic,
    "workspace_limit": twophase.set_workspace_limit,
    "num_threads": twophase.set_num_threads,
    "helper_spin_us": twophase.set_helper_spin,
    "log_level": twophase.set_log_level,
    "sanitize": twophase.set_sanitize,
}


@pytest.fixture(autouse=True)
def restore_settings() -> Iterator[None]:
    """Every setting and the logger's level put back after each test, through the setters."""
    old = dataclasses.asdict(config.settings)
    level = logging.getLogger("twophase").level
    try:
        yield
    finally:
        for name, value in old.items():
            if getattr(config.settings, name) != value:
                _SETTERS[name](value)
        logging.getLogger("twophase").setLevel(level)


# ---- setters


@pytest.mark.parametrize(
    ("setter", "arg", "bad"),
    [
        ("set_cache_limit", "entries", -1),
        ("set_cache_limit", "entries", "abc"),
        ("set_cache_limit", "entries", 2.0),
        ("set_cache_limit", "entries", None),
        ("set_num_threads", "n", "abc"),
        ("set_num_threads", "n", 2.7),
        ("set_num_threads", "n", True),
        ("set_num_threads", "n", -1),
        ("set_helper_spin", "us", None),
        ("set_helper_spin", "us", -1),
        ("set_helper_spin", "us", 1.5),
        ("set_workspace_limit", "nbytes", -1),
        ("set_workspace_limit", "nbytes", 1e6),
        ("set_workspace_limit", "nbytes", "1000"),
        ("set_log_level", "level", "bogus"),
        ("set_log_level", "level", -1),
        ("set_log_level", "level", None),
        ("set_log_level", "level", True),
        ("set_cache_enabled", "enabled", "no"),
        ("set_cache_enabled", "enabled", 0),
        ("set_launch_blocking", "enabled", "yes"),
        ("set_deterministic", "enabled", 1),
        ("set_sanitize", "enabled", None),
    ],
)
def test_a_bad_value_raises_a_param_error_and_changes_nothing(setter: str, arg: str, bad: object) -> None:
    before = dataclasses.asdict(config.settings)
    level = logging.getLogger("twophase").level
    with pytest.raises(ParamError) as info:
        getattr(twophase, setter)(bad)
    assert info.value.op == setter and info.value.arg == arg and info.value.expected
    assert repr(bad) in str(info.value)
    assert dataclasses.asdict(config.settings) == before
    assert logging.getLogger("twophase").level == level


@pytest.mark.parametrize(
    ("level", "stored"),
    [
        (5, 5),
        (logging.DEBUG, "DEBUG"),
        (np.int64(20), "INFO"),
        ("error", "ERROR"),
        ("Warning", "WARNING"),
        ("warn", "WARNING"),  # an alias reads as its standard name, as 30 does (it read 'WARN')
        ("FATAL", "CRITICAL"),
    ],
)
def test_log_level_takes_ints_and_names_in_any_case(level: object, stored: str | int) -> None:
    twophase.set_log_level(level)  # type: ignore[arg-type]
    assert config.settings.log_level == stored
    assert logging.getLogger("twophase").level == logging.getLevelNamesMapping().get(str(stored), stored)
    twophase.set_log_level(config.settings.log_level)  # what it stored is accepted back


@pytest.mark.parametrize(
    ("setter", "name", "value"),
    [
        ("set_cache_limit", "cache_limit", 0),
        ("set_cache_limit", "cache_limit", np.int64(7)),
        ("set_num_threads", "num_threads", 3),
        ("set_helper_spin", "helper_spin_us", 0),
        ("set_workspace_limit", "workspace_limit", 0),
        ("set_workspace_limit", "workspace_limit", None),
        ("set_cache_enabled", "cache_enabled", False),
        ("set_deterministic", "deterministic", True),
    ],
)
def test_good_values_are_stored_as_plain_python_values(setter: str, name: str, value: object) -> None:
    getattr(twophase, setter)(value)
    got = getattr(config.settings, name)
    assert got == value and type(got) is type(value if value is None or isinstance(value, bool) else int(value))


def test_a_refused_workspace_limit_leaves_ops_working(dev) -> None:
    with pytest.raises(ParamError):
        twophase.set_workspace_limit(-1)
    np.testing.assert_array_equal(twophase.relu(dev.tensor(np.array([-1.0, 2.0]))).numpy(), [0.0, 2.0])


# ---- environment, in process: Settings() reads the variables as import does


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("TWOPHASE_NUM_THREADS", "abc"),
        ("TWOPHASE_NUM_THREADS", "1.5"),
        ("TWOPHASE_NUM_THREADS", "-2"),
        ("TWOPHASE_WORKSPACE_LIMIT", "1e6"),
        ("TWOPHASE_WORKSPACE_LIMIT", "-1"),
        ("TWOPHASE_CACHE_LIMIT", "-5"),
        ("TWOPHASE_HELPER_SPIN_US", "-1"),
        ("TWOPHASE_LOG_LEVEL", "bogus"),
        ("TWOPHASE_LOG_LEVEL", "-3"),
        ("TWOPHASE_DETERMINISTIC", "maybe"),
        ("TWOPHASE_DISABLE_CACHE", "2"),
        ("TWOPHASE_LAUNCH_BLOCKING", "y"),
        ("TWOPHASE_SANITIZE", "enabled"),
        ("TWOPHASE_CACHE_LIMIT", "1_000"),
        ("TWOPHASE_NUM_THREADS", "+3"),
    ],
)
def test_a_bad_variable_raises_a_param_error_naming_it(monkeypatch: pytest.MonkeyPatch, var: str, raw: str) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(ParamError) as info:
        config.Settings()
    assert info.value.arg == var and repr(raw) in str(info.value) and info.value.expected


@pytest.mark.parametrize(
    ("var", "raw", "name", "value"),
    [
        ("TWOPHASE_DETERMINISTIC", "YES", "deterministic", True),
        ("TWOPHASE_DETERMINISTIC", "Off", "deterministic", False),
        ("TWOPHASE_SANITIZE", "true", "sanitize", True),
        ("TWOPHASE_LAUNCH_BLOCKING", "0", "launch_blocking", False),
        ("TWOPHASE_DISABLE_CACHE", "on", "cache_enabled", False),
        ("TWOPHASE_DISABLE_CACHE", "no", "cache_enabled", True),
        ("TWOPHASE_NUM_THREADS", " 3 ", "num_threads", 3),
        ("TWOPHASE_WORKSPACE_LIMIT", "0", "workspace_limit", 0),
        ("TWOPHASE_WORKSPACE_LIMIT", "", "workspace_limit", None),
        ("TWOPHASE_CACHE_LIMIT", "0", "cache_limit", 0),
        ("TWOPHASE_HELPER_SPIN_US", "0", "helper_spin_us", 0),
        ("TWOPHASE_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("TWOPHASE_LOG_LEVEL", "20", "log_level", "INFO"),
        ("TWOPHASE_LOG_LEVEL", "5", "log_level", 5),
    ],
)
def test_good_variables_read_as_their_setters_take_them(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str, name: str, value: object
) -> None:
    monkeypatch.setenv(var, raw)
    assert getattr(config.Settings(), name) == value


# ---- environment, at import


def _import(**env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    full.update(env)
    code = "import json, dataclasses, twophase; print(json.dumps(dataclasses.asdict(twophase.settings)))"
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("TWOPHASE_NUM_THREADS", "abc"),
        ("TWOPHASE_WORKSPACE_LIMIT", "1e6"),
        ("TWOPHASE_LOG_LEVEL", "bogus"),
        ("TWOPHASE_DETERMINISTIC", "maybe"),
    ],
)
def test_import_fails_on_a_bad_variable_with_a_param_error_naming_it(var: str, raw: str) -> None:
    r = _import(**{var: raw})
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("twophase.errors.ParamError:") and var in last and repr(raw) in last
    assert "expected" in last


def test_import_reads_good_variables() -> None:
    r = _import(
        TWOPHASE_NUM_THREADS="2",
        TWOPHASE_LOG_LEVEL="info",
        TWOPHASE_DETERMINISTIC="On",
        TWOPHASE_WORKSPACE_LIMIT="4096",
        TWOPHASE_HELPER_SPIN_US="0",
        TWOPHASE_CACHE_LIMIT="0",
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert (s["num_threads"], s["log_level"], s["deterministic"]) == (2, "INFO", True)
    assert (s["workspace_limit"], s["helper_spin_us"], s["cache_limit"]) == (4096, 0, 0)
