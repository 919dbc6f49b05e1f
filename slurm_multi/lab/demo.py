"""`make demo`: the main job on the lab cluster.

A 3-node `dummy_lastrank` run submitted as a user would (`slurm-multi submit --wait`), exiting with its verdict;
`make demo MODEL=<name>` runs another sample model, making the lab's PyTorch base first when it needs it
(docs/lab.md).
"""

import os
import sys

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_model_cards,
    select_model_cards,
)
from slurm_multi import cli
from slurm_multi.lab.pytorch import PYTORCH_BASE, ensure_pytorch_base
from slurm_multi.paths import project_root

DEMO_RESULTS_DIR = "/tmp/slurm-multi-demo"
DEFAULT_MODEL = "dummy_lastrank"


def _needs_pytorch_base(model: str) -> bool:
    """Whether a Dockerfile of the model's card builds on the lab's PyTorch base."""
    zoo = project_root() / "models"
    cards = select_model_cards(load_model_cards(zoo / "models.json"), [model])
    return any(
        PYTORCH_BASE in path.read_text() for card in cards for path in zoo.glob(f"{card['dockerfile']}*.Dockerfile")
    )


def main() -> int:
    model = os.environ.get("MODEL") or DEFAULT_MODEL
    if _needs_pytorch_base(model):
        ensure_pytorch_base(["node1"])
    return cli.main(["submit", "--nodes", "3", "--tags", model, "--results-dir", DEMO_RESULTS_DIR, "--wait"])


if __name__ == "__main__":
    sys.exit(main())
