"""The `encode_distilled` stage: the teacher's distilled pairs -> token ids, as `encode` does.

Contract:
  reads   the `distill` artifact (`train` pairs hold the teacher's translations, `dev` pairs
          are the prepared ones) and the `vocab` artifact's `spm.model`.
  writes  `<workdir>/encode_distilled/<key>/` in the layout of pipelines/encode.py, which
          this stage runs on other pairs.

Run it alone, locally or on Dataflow, with the flags of pipelines/encode.py:

    PADIR_DATA_ROOT=/path/to/data python -m pipelines.encode_distilled \
        --config configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import sys
from typing import Sequence

from components import artifacts
from components import config as config_lib
from pipelines import encode, options as options_lib


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Recomputes the `encode_distilled` artifact (the student's training data) from the
    complete distill artifact and vocab."""
    return encode.encode_pairs(config, "encode_distilled", pipeline_args)


def main(argv: Sequence[str] | None = None) -> int:
    return options_lib.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the package so pickled functions refer to `pipelines.encode`, not `__main__`.
    from pipelines import encode_distilled as _encode_distilled

    sys.exit(_encode_distilled.main(sys.argv[1:]))
