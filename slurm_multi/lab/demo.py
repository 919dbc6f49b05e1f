"""`make demo`: the main job on the lab cluster.

A 3-node `dummy_lastrank` run submitted as a user would (`slurm-multi submit --wait`), exiting with its verdict;
`make demo MODEL=<name>` runs another sample model, making the lab's PyTorch base first when it needs it
(docs/lab.md). `make demo RUNTIME=charliecloud` runs it with no Docker: built by `ch-image` on node1, one squashfs
file in the shared cache, `ch-run` on every node (docs/no-docker.md).
"""

import os
import sys

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_model_cards,
    select_model_cards,
)
from slurm_multi import cli
from slurm_multi.lab.pytorch import PYTORCH_BASE, build_base_tar, ensure_pytorch_base
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


def demo_submit_args(model: str, runtime: str) -> list[str]:
    """`slurm-multi submit`'s arguments for the demo of `model` under `runtime` (submit refuses a runtime it does not
    know, naming the choices)."""
    args = ["submit", "--nodes", "3", "--tags", model, "--results-dir", DEMO_RESULTS_DIR, "--wait"]
    return args + ["-e", f"container_runtime={runtime}"]


def main() -> int:
    model = os.environ.get("MODEL") or DEFAULT_MODEL
    runtime = os.environ.get("RUNTIME") or "docker"
    args = demo_submit_args(model, runtime)
    if _needs_pytorch_base(model):
        # Docker imports the base on node1; Charliecloud imports the tar the lab's site file names for it.
        if runtime == "charliecloud":
            build_base_tar()
        else:
            ensure_pytorch_base(["node1"])
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
