"""A non-editable install works: the wheel built from this checkout, installed into a fresh virtual environment (with
the system's site-packages, so torch and transformers need no download), runs `hf-loopspec generate` on the embedded
model and `hf-loopspec export default` from a folder outside the checkout; the wheel ships the templates, the embedded
model and its card, and the installed metadata carries the project URL that every install line quotes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
from processes import ROOT

SHIPPED = ("hf_loopspec/hub/templates/model_card.md", "hf_loopspec/hub/templates/configuration_ouro.py",
           "hf_loopspec/hub/templates/modeling_ouro.py", "hf_loopspec/hub/templates/custom_generate/generate.py",
           "hf_loopspec/assets/default_model/config.json", "hf_loopspec/assets/default_model/model.safetensors",
           "hf_loopspec/assets/default_model/tokenizer.json", "hf_loopspec/assets/default_model/README.md")
NOT_COPIED = (".git", "build", "dist", "*.egg-info", "__pycache__", "bench_results", "tests", ".venv")


def run(command: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HOME=str(tmp_path / "hf"))
    source = tmp_path / "source"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hf_loopspec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert set(SHIPPED) <= names, sorted(set(SHIPPED) - names)
        card = archive.read("hf_loopspec/assets/default_model/README.md").decode()
    assert card == (ROOT / "model_cards" / "hf-loopspec-default" / "README.md").read_text(encoding="utf-8")

    venv = tmp_path / "venv"  # without a pip of its own: this interpreter's pip installs into it (`--python`)
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], tmp_path, env)
    python, cli = venv / "bin" / "python", venv / "bin" / "hf-loopspec"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--force-reinstall",
         str(wheel)], tmp_path, env)
    work = tmp_path / "work"  # outside the checkout: the installed package is what runs
    work.mkdir()
    generated = run([str(cli), "generate", "def fibonacci(n):", "--max-new-tokens", "8"], work, env)
    assert generated.stdout.strip() and "[auto] 8 new tokens" in generated.stderr, generated.stderr  # the default
    # where the package was imported from, and the export, in one process (the console script ran above)
    probe = run([str(python), "-c", "import json, sys, hf_loopspec, hf_loopspec.hub.install as i; "
                 "print(json.dumps([hf_loopspec.__file__, i.project_url()])); from hf_loopspec.cli import main; "
                 "sys.exit(main(['export', 'default', 'exported']))"], work, env)
    location, url = json.loads(probe.stdout.strip().splitlines()[0])
    assert Path(location).is_relative_to(venv), location  # not the checkout, not an editable install
    assert url == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    requirements = (work / "exported" / "custom_generate" / "requirements.txt").read_text()
    assert f"git+{url}" in requirements and (work / "exported" / "modeling_ouro.py").is_file()


@pytest.mark.parametrize("name", ["hf_loopspec", "hf_loopspec.hub"])
def test_the_public_names_are_listed_by_dir_and_help(name):
    """The packages load their public names lazily (`__getattr__`): without a `__dir__`, `dir()`, `help()` and tab
    completion showed only the names already loaded (`register` of 16)."""
    import importlib
    import pydoc

    module = importlib.import_module(name)
    assert set(module.__all__) <= set(dir(module))
    page = pydoc.render_doc(module, renderer=pydoc.plaintext)
    assert all(getattr(module, public) is not None and public in page for public in module.__all__)


def test_the_sdist_carries_the_whole_test_suite(tmp_path):
    """setuptools puts `tests/test*.py` in an sdist on its own, without the helpers they import (`conftest.py`,
    `inputs.py`, ...) or the files they read (`scripts/`, `docs/`, ...): the suite of an unpacked sdist could not even
    be collected. Every file of those folders is in."""
    source = tmp_path / "source"
    copied = [pattern for pattern in NOT_COPIED if pattern != "tests"]
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*copied))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                 "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")], source, env)
    name = built.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "dist" / name) as archive:
        shipped = {Path(*Path(member).parts[1:]).as_posix() for member in archive.getnames()}
    read = ("tests", "scripts", "examples", "docs", "model_cards", "bench_results")  # what the suite reads
    suite = {path.relative_to(source).as_posix() for folder in read for path in (source / folder).rglob("*")
             if path.is_file()} | {"BENCHMARKS.md", "README.md", "pyproject.toml"}
    assert suite and suite <= shipped, sorted(suite - shipped)
