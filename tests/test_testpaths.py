"""Every package's tests run: `make test` (the README's test command, and CI's) collects pytest.ini's testpaths only."""

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_with_tests_is_in_testpaths():
    config = configparser.ConfigParser()
    config.read(ROOT / "pytest.ini")
    testpaths = set(config["pytest"]["testpaths"].split())
    with_tests = {path.parent.name for path in ROOT.glob("*/tests/__init__.py")} | {"tests"}
    assert with_tests - testpaths == set(), "packages whose tests pytest.ini's testpaths leaves out"
