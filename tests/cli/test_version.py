"""`trainer --version`: the installed package's version, exit 0."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from trainer import cli


def test_version_prints_the_installed_packages_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"trainer {version('trainer')}\n"
