"""README.md stays true: every `amp ...` command line in its code blocks names only options
its subcommand has, and its YAML examples pass amp's strict config schema."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _amp_commands() -> list[list[str]]:
    cmds = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("amp "):
                cmds.append(shlex.split(line))
    return cmds


def test_readme_has_amp_commands():
    names = {c[1] for c in _amp_commands()}
    assert {"convert", "tune", "bench", "inspect"} <= names, names


@pytest.mark.parametrize("cmd", _amp_commands(), ids=lambda c: " ".join(c[:2]))
def test_readme_command_options_exist(cmd):
    from amp_cli.cli import main

    sub = main.commands[cmd[1]]
    known = set()
    for param in sub.params:
        known.update(getattr(param, "opts", []))
        known.update(getattr(param, "secondary_opts", []))
    flags = [t.split("=", 1)[0] for t in cmd[2:] if t.startswith("-")]
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{' '.join(cmd)}: no such option(s) {unknown}"


def test_readme_yaml_examples_parse(tmp_path):
    from amp_cli.config import ConvertConfig, apply_yaml, read_yaml

    blocks = _blocks("yaml")
    assert blocks
    for i, text in enumerate(blocks):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(text)
        apply_yaml(ConvertConfig(), read_yaml(path), str(path))  # raises on an unknown key


def test_example_config_is_valid_and_complete():
    """configs/example.yaml parses and shows every CUDA switch with its default."""
    import dataclasses

    from amp_cli.config import ConvertConfig, CudaConfig, apply_yaml, read_yaml

    path = README.parent / "configs" / "example.yaml"
    data = read_yaml(path)
    cfg = apply_yaml(ConvertConfig(), data, str(path))
    assert set(data["cuda"]) == {f.name for f in dataclasses.fields(CudaConfig)}
    assert cfg.cuda == CudaConfig()
