"""benchmarks/cpu_bench.py: its amp rows use the CLI's configs, bad options are usage errors, and
the models it builds in code (amp_cli.models.GraphBuilder) are valid. No timing is asserted."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_bench():
    spec = importlib.util.spec_from_file_location("cpu_bench", ROOT / "benchmarks/cpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("precision,db", [("fp32", None), ("bf16", None), ("fp32", "tdb")])
def test_convert_config_is_the_cli_one(cpu_bench, precision, db):
    from amp_cli.cli.common import build_config

    cli = build_config("llvm", precision, None, None, (), None, (), (), tuning_db=db)
    assert cpu_bench.convert_config(precision, db).to_dict() == cli.to_dict()


@pytest.mark.parametrize("argv", [["--precisions", "fp32,fp8"], ["--tune-budget", "ten"]])
def test_bad_options_are_usage_errors(cpu_bench, argv):
    with pytest.raises(SystemExit) as exc:
        cpu_bench.main(argv + ["--json", ""])
    assert exc.value.code == 2


def test_models_build_and_run(cpu_bench):
    import onnx
    import onnxruntime as ort

    for model in (cpu_bench.build_bert(layers=1, seq=8, hidden=32, heads=4, ffn=64),
                  cpu_bench.build_resnet50(blocks=(1,), num_classes=5, image=32)):
        onnx.checker.check_model(model)
        inp = model.graph.input[0]
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        sess = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        out = sess.run(None, {inp.name: np.ones(shape, "float32")})[0]
        want = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
        assert list(out.shape) == want and np.isfinite(out).all()
