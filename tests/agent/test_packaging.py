"""A GPU node installs the agent alone: its wheel pulls only requests, psutil and pynvml, and runs without Django."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import worker_agent

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = REPO_ROOT / "worker_agent"
# The distributions the agent needs at run time, and the modules they bring (requests' own included).
RUNTIME_MODULES = ("requests", "urllib3", "idna", "certifi", "charset_normalizer", "psutil", "pynvml")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the agent's wheel from a copy of worker_agent/ (the source tree stays clean)."""
    work = tmp_path_factory.mktemp("agent-wheel")
    source = work / "src"
    shutil.copytree(AGENT_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (built,) = (work / "dist").glob("*.whl")
    return built


def test_wheel_depends_on_requests_psutil_and_pynvml_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert sorted(r.split(">=")[0] for r in requires) == ["nvidia-ml-py", "psutil", "requests"]
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == {"worker_agent"}
    assert "worker_agent/protocol.py" in names  # the wire contract ships with the agent
    assert "simpletuner = worker_agent.cli:simpletuner_main" in entry_points


def test_wheel_version_is_the_package_version():
    project = tomllib.loads((AGENT_DIR / "pyproject.toml").read_text())["project"]
    assert project["version"] == worker_agent.__version__


def test_agent_sources_never_import_django():
    forbidden = ("django", "rest_framework", "daphne", "channels", "celery", "job_queue", "workers", "audit", "simpletuner_site")
    for path in AGENT_DIR.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                top = words[1].split(".")[0]
                assert top not in forbidden, f"{path.name}: {line.strip()}"


@pytest.fixture(scope="module")
def agent_only_python(wheel, tmp_path_factory):
    """A fresh virtual environment with the agent's wheel and its three dependencies, and nothing else."""
    root = tmp_path_factory.mktemp("agent-venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    ours = Path(sysconfig.get_paths()["purelib"])
    for module in RUNTIME_MODULES:
        source = ours / module
        if not source.exists():
            (source,) = [p for p in ours.glob(f"{module}*") if p.suffix in (".py", ".so")]
        target = site / source.name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    return python


def _run(python, *args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SIMPLETUNER_", "DJANGO", "PYTHON"))}
    clean.update(env or {})
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=60, env=clean, cwd="/")


def test_agent_runs_where_django_is_not_installed(agent_only_python):
    assert _run(agent_only_python, "-c", "import django").returncode != 0
    help_text = _run(agent_only_python, "-m", "worker_agent", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--orchestrator-url" in help_text.stdout and "--persistent" in help_text.stdout
    imported = _run(
        agent_only_python,
        "-c",
        "import sys, worker_agent.agent, worker_agent.example_trainer, worker_agent.protocol; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework')))",
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"


def test_agent_only_install_reports_a_missing_setting_in_one_line(agent_only_python):
    result = _run(agent_only_python, "-m", "worker_agent", env={"SIMPLETUNER_WORKER_TOKEN": "wt_x"})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no orchestrator URL" in result.stderr and "SIMPLETUNER_ORCHESTRATOR_URL" in result.stderr
