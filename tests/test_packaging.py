"""A non-editable install: the wheel carries the configs and the programs, and runs outside the repository."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.train import REPO

from vit3.engine.config import CONFIG_DIR, resolve_config_path

# What a wheel is built from (a copy: an in-tree build/ folder could hold stale modules).
SOURCES = ("pyproject.toml", "README.md", "vit3", "kernels", "configs")

# Run in the installed package, from a folder outside the repository: every shipped config loads, and the
# README's main job (the embedded demo, shortened to one epoch of the tiny test model) trains.
CHECK = """
import json, sys
from pathlib import Path
import vit3
from vit3.engine import load_config
from vit3.engine.config import CONFIG_DIR
files = sorted(p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_DIR.rglob("*.yaml"))
tasks = {f: load_config(f"configs/{f}").task for f in files}
print(json.dumps({"vit3": vit3.__file__, "config_dir": str(CONFIG_DIR), "tasks": tasks}))
"""


def _copy_sources(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    dst.mkdir(parents=True)
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project built as a wheel (``pip wheel --no-deps --no-build-isolation``) and installed with
    ``pip install --target`` (no editable finder): ``(site dir, environment that imports it first)``."""
    root = tmp_path_factory.mktemp("pkg")
    src, wheels, site = _copy_sources(root / "src"), root / "wheels", root / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # the environment's setuptools when it has one (no download); else pip's isolated build environment
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", *isolation, "-w", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("vit3-*.whl")
    inst = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    # PYTHONPATH comes before the venv's editable finder of the repository's vit3.
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "VIT3_DEBUG": "1"}
    return site, env


def test_wheel_ships_every_config_and_reads_them_outside_the_repo(installed, tmp_path):
    site, env = installed
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(report["vit3"]).is_relative_to(site) and Path(report["config_dir"]).is_relative_to(site)
    shipped = sorted(p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_DIR.rglob("*.yaml"))
    assert sorted(report["tasks"]) == shipped and len(shipped) > 40
    assert report["tasks"]["dense/demo_detection.yaml"] == "detection"
    assert report["tasks"]["generation/demo_mnist.yaml"] == "generation"


def test_wheel_ships_the_cpu_extensions_sources(installed, tmp_path):
    """The installed ``vit3.kernels.cpp`` finds every file the C++ extension builds from (each op's source and
    the shared header), in the installed package."""
    site, env = installed
    code = (
        "import json; from vit3.kernels import cpp; "
        "print(json.dumps([str(f) for f in cpp.FILES if f.is_file()]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [Path(f) for f in json.loads(proc.stdout.strip().splitlines()[-1])]
    names = ["cpe.cpp", "dwconv.cpp", "lean_mlp.cpp", "mix.cpp", "swiglu.cpp", "ttt_block.cpp", "vit3_cpu.h"]
    assert sorted(f.name for f in found) == names
    assert all(f.is_relative_to(site) for f in found)


@pytest.mark.slow
def test_installed_train_program_runs_the_readme_demo_outside_the_repo(installed, tmp_path):
    """``vit3-train --config configs/demo_mnist.yaml`` from an empty folder, on the embedded digits."""
    site, env = installed
    out = tmp_path / "run"
    cmd = [
        str(site / "bin" / "vit3-train"), "--config", "configs/demo_mnist.yaml", f"output={out}",
        "train.epochs=1", "train.warmup_epochs=0", "train.progress=false", "data.batch_size=250",
        "model.name=test_h_vit3", "model.kwargs={img_size: 32, in_chans: 1}",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["epoch"] == 1 and (out / "last.pt").is_file()
    saved = (out / "config.yaml").read_text()
    assert "git_commit: null" in saved  # an installed wheel is no source checkout
    # the same program through python -m, and the README's eval command on its checkpoint
    ev = subprocess.run(
        [sys.executable, "-m", "vit3.scripts.eval", "--checkpoint", str(out / "last.pt"), "eval.flops=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    assert json.loads((out / "last.eval.json").read_text())["results"][0]["images"] == 1000


def test_configs_paths_fall_back_to_the_installed_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert (
        resolve_config_path("configs/dense/demo_detection.yaml") == CONFIG_DIR / "dense/demo_detection.yaml"
    )
    assert resolve_config_path("configs/nowhere.yaml") == Path("configs/nowhere.yaml")
    local = tmp_path / "configs" / "default.yaml"
    local.parent.mkdir()
    local.write_text("base: ../other.yaml\n")
    assert resolve_config_path("configs/default.yaml") == Path("configs/default.yaml")  # a local file wins
