"""The ``amp`` command line: each command builds a config, makes one library call, renders it.

Exit codes: 0 ok, 1 amp error (one line on stderr), 2 usage error, 3 bench gate failed,
130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import click

from .bench import bench
from .common import EPILOG, AmpGroup
from .convert import convert
from .inspect import inspect
from .tune import tune


@click.group(cls=AmpGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h",
                                                                                  "--help"]})
@click.version_option(package_name="amp-cli", prog_name="amp")
def main():
    """amp: convert ONNX / PyTorch models to fp16 / bf16 mixed precision with Apache TVM,
    compile them safely for NVIDIA GPUs (any vector width, tensor cores) or the CPU, tune,
    and benchmark against fp32 and ONNX Runtime.

    \b
    Typical use:
      amp convert model.onnx -o out/ --target cuda:sm_90
      amp convert model.onnx -o out/ --target llvm --precision bf16
      amp tune model.onnx --target cuda:sm_90 --db tuning/ --trials 200
      amp bench out/ --compare fp32,ort --max-rel-error 1e-2
    """


for command in (convert, tune, bench, inspect):
    main.add_command(command)


def run():  # pragma: no cover - console entry
    main(prog_name="amp")


if __name__ == "__main__":  # pragma: no cover
    run()
