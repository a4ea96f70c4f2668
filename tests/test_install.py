"""The lean install: requirements.txt brings in what the server runs and none of the test tools.

The dependency closure is resolved from the installed distributions' own metadata (their
``Requires-Dist``, markers evaluated for this interpreter, extras followed), so a runtime pin that
pulled a test tool in transitively would be caught, not only one named in requirements.txt.
"""

import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.e2e.harness import REPO_ROOT

TEST_TOOLS = {"pytest", "playwright", "moto", "schemathesis", "factory-boy", "import-linter"}


def pins(name):
    """Return the requirements named in requirements file ``name`` (its ``-r`` includes followed)."""
    found = []
    for line in (REPO_ROOT / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            found += pins(line.removeprefix("-r ").strip())
        else:
            found.append(Requirement(line))
    return found


def closure(requirements):
    """Return the canonical names of ``requirements`` and of everything they require, transitively."""
    seen = set()
    pending = [(requirement, "") for requirement in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        wanted = [(name, "")] + [(name, canonicalize_name(e)) for e in requirement.extras]
        for key in wanted:
            if key in seen:
                continue
            seen.add(key)
            for line in metadata.distribution(name).requires or ():
                pending.append((Requirement(line), key[1]))
    return {name for name, _ in seen}


def test_the_runtime_requirements_bring_in_no_test_tool():
    runtime = closure(pins("requirements.txt"))

    assert {"django", "daphne", "celery", "psycopg", "boto3"} <= runtime
    assert not runtime & TEST_TOOLS


def test_the_dev_requirements_bring_in_every_test_tool():
    assert TEST_TOOLS <= closure(pins("requirements-dev.txt"))


def test_pyprojects_default_dependencies_bring_in_no_test_tool():
    # `pip install .` (no extra) installs the [project] dependencies; `simpletuner` runs from them.
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = closure(Requirement(line) for line in project["dependencies"])

    assert "daphne" in runtime
    assert not runtime & TEST_TOOLS
    assert TEST_TOOLS <= closure(Requirement(line) for line in project["optional-dependencies"]["test"])
