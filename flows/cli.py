"""The `padir` command line: thin wrappers that parse and call one library function."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from components import artifacts
from components import config as config_lib
from components.corpus import CorpusError

# Errors that mean "the input is wrong", reported as one line rather than a traceback.
USER_ERRORS = (config_lib.ConfigError, CorpusError, artifacts.IncompleteArtifactError)

# Stage name -> "module:function" that computes it (imported on use: heavy). Beam stages'
# functions take `(config, beam_args)`, the training stages' just `(config)`.
BEAM_STAGES = {
    "prepare": "pipelines.prepare:run",
    "vocab": "pipelines.vocab:run",
    "encode": "pipelines.encode:run",
}
TRAINING_STAGES = {
    "teacher": "model.stages:run_teacher",
    "train": "model.stages:run_student",
}


def _load(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def run_stage(name: str, config: config_lib.Config, beam_args: Sequence[str] = ()):
    """Recomputes one stage from its (complete) inputs and returns its artifact."""
    if name in BEAM_STAGES:
        return _load(BEAM_STAGES[name])(config, beam_args=beam_args)
    if beam_args:
        raise config_lib.ConfigError(f"stage {name} is not a Beam job: unexpected {beam_args}")
    return _load(TRAINING_STAGES[name])(config)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set vocab.size=4000")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="padir", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    stage = commands.add_parser(
        "stage", help="recompute one stage from its inputs (extra flags go to Beam)")
    stage.add_argument("name", choices=[*BEAM_STAGES, *TRAINING_STAGES])
    _add_config_args(stage)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    try:
        config = config_lib.load(args.config, args.set)
        if args.command == "stage":
            artifact = run_stage(args.name, config, beam_args=extra)
            print(f"{args.name}: {artifact.uri}")
    except USER_ERRORS as e:
        parser.exit(2, f"padir: error: {e}\n")
    except artifacts.StageStopped as e:
        parser.exit(3, f"padir: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
