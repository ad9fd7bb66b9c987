"""The distribution's metadata: one version source, the license text, type information, the reference's
top-level packages and the console scripts."""
import tomllib
from pathlib import Path

import mindio

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once():
    assert "version" not in PROJECT["project"] and "version" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mindio.__version__"}
    assert mindio.__version__.count(".") == 2


def test_license_changelog_urls_and_typing():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["project"]["license"] == "Apache-2.0" and PROJECT["project"]["urls"]
    assert (ROOT / "CHANGELOG.md").exists() and (ROOT / "mindio" / "py.typed").exists()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["mindio"]


def test_the_reference_packages_and_the_commands_ship():
    assert {"mindio*", "mindio_ttp*", "mindio_acp*"} <= set(PROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    assert PROJECT["project"]["scripts"]["mindio"] == "mindio.cli:main"
