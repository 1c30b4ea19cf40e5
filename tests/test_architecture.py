"""The package's shape, checked (docs/architecture.md): layers and backend independence
(import-linter contracts in setup.cfg), no import cycles, no cross-module ``_private`` imports,
TVM reached only through ``tvm_compat``, IR keys spelled once, modules small or saying why, and
every CUDA switch read by a registered rewrite or rule."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import amp_cli

PACKAGE = Path(amp_cli.__file__).resolve().parent
REPO = PACKAGE.parent
MAX_LINES = 520  # "about 500"; a longer module says why in its docstring ("Long because")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_import_linter_contracts_hold():
    importlinter = pytest.importorskip("importlinter.cli")
    assert importlinter.lint_imports(config_filename=str(REPO / "setup.cfg")) == 0


def test_no_import_cycles():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("amp_cli")
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # Tarjan's strongly connected components: any component of two or more is a cycle
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    assert cycles == []


def test_no_private_names_imported_across_modules():
    leaks = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        leaks.append(f"{_name(path)}: from {node.module} import {alias.name}")
    assert leaks == []


def test_tvm_is_imported_only_in_tvm_compat():
    direct = []
    for path, tree in _modules():
        if path.name == "tvm_compat.py":
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            direct += [f"{_name(path)}: {n}" for n in names if n.split(".")[0] in ("tvm",
                                                                                  "tvm_ffi")]
    assert direct == []


def test_ir_attribute_keys_are_spelled_once():
    from amp_cli import ir_attrs

    keys = {v for k, v in vars(ir_attrs).items() if k.isupper() and isinstance(v, str)}
    literals = []
    for path, tree in _modules():
        if path.name == "ir_attrs.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in keys:
                literals.append(f"{_name(path)}:{node.lineno}: {node.value!r}")
    assert literals == []


def test_modules_are_small_or_say_why():
    long = []
    for path, tree in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and "Long because" not in (ast.get_docstring(tree) or ""):
            long.append(f"{_name(path)}: {lines} lines")
    assert long == []


def test_every_cuda_switch_is_read_by_the_pipeline():
    from amp_cli.backends.cuda import pipeline, registry
    from amp_cli.config import CudaConfig

    fields = {f.name for f in dataclasses.fields(CudaConfig)}
    assert pipeline.switch_names() == fields
    orders = [(e.stage, e.order) for e in registry.ENTRIES]
    assert len(orders) == len(set(orders)), "two entries share a stage and order"


def test_the_report_labels_every_graph_rewrite_count():
    from amp_cli.backends.cuda import pipeline  # noqa: F401 - registers everything
    from amp_cli.backends.cuda import registry

    for entry in registry.ENTRIES:
        if entry.stage in ("graph", "tir") and entry.name != "matmul_nt":
            assert entry.labels, entry.name
    assert registry.report_labels()["convs_as_gemm"] == "convolutions as GEMMs"


def test_shipped_policies_are_package_data():
    from amp_cli.precision.policy import POLICY_DIR, default_policy_file

    assert POLICY_DIR.is_relative_to(PACKAGE)
    for kind, precision in (("cuda", "fp16"), ("cuda", "bf16"), ("llvm", "fp16"),
                            ("llvm", "bf16")):
        assert default_policy_file(kind, precision).is_file()
    setup_cfg = (REPO / "setup.cfg").read_text()
    assert "precision/policies/*.yaml" in setup_cfg
