"""What users install is what the tests check: a wheel built from this repo, installed (not
editable) into a fresh virtual environment, converts the demo model with the same report --
the shipped op policy included -- as the editable install the other tests use."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parent.parent
SHAPE = ["--input-shape", "input:1x3x32x32"]


def _run(cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with amp installed from a freshly built wheel. Its dependencies come from
    the test environment's site-packages (a .pth line: no downloads), whose editable amp is not
    visible there (.pth files of an added directory are not processed)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a clean copy: a stale build/ in the checkout would leak files into the wheel
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".gpu", "out", "generated"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", tmp / "dist", src])
    wheel, = (tmp / "dist").glob("amp_cli-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    site = Path(_run([venv / "bin" / "python", "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())
    (site / "amp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
          "--no-deps", "-q", wheel])
    return venv


def test_wheel_install_converts_like_the_editable_one(wheel_venv, tmp_path):
    from amp_cli import models

    model = tmp_path / "tiny_cnn.onnx"
    onnx.save(models.tiny_cnn(), str(model))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([wheel_venv / "bin" / "python", "-c",
                  "import amp_cli; print(amp_cli.__file__)"], cwd=tmp_path, env=env).stdout
    assert str(wheel_venv) in where, where  # the wheel's amp_cli, not the repo's
    reports = {}
    for name, amp in (("wheel", wheel_venv / "bin" / "amp"),
                      ("editable", Path(sys.executable).with_name("amp"))):
        out = tmp_path / name
        _run([amp, "convert", model, "-o", out, "--target", "llvm", *SHAPE], cwd=tmp_path,
             env=env)
        reports[name] = json.loads((out / "report.json").read_text())
    wheel, editable = reports["wheel"], reports["editable"]
    policy = wheel["config"]["precision"]["policy"]
    assert policy["always"] and policy["follow"] and policy["never"]  # the shipped policy
    assert wheel["config"] == editable["config"]
    for key in ("ops_by_dtype", "op_dtypes", "kept_fp32", "casts_inserted"):
        assert wheel["precision"][key] == editable["precision"][key], key
    assert wheel["accuracy"]["worst"] == editable["accuracy"]["worst"]
