"""A copy of the MAD-style test zoo (tests/fixtures/model_zoo) that builds offline.

Its Dockerfiles are `FROM scratch` and `COPY busybox` from their build context, the zoo's `docker/` directory
(MAD's default context), so the copy gets the host's /bin/busybox there. Each copy also gets a file of its own
in that context: its images have their own build fingerprint, so one test never reuses another test's image
from the session's daemon.
"""

import shutil
import uuid
from pathlib import Path

FIXTURE_ZOO = Path(__file__).resolve().parents[2] / "fixtures" / "model_zoo"


def make_model_zoo(destination: Path) -> Path:
    """Copy the fixture zoo to `destination` (which must not exist) with busybox in docker/; returns it."""
    shutil.copytree(FIXTURE_ZOO, destination)
    shutil.copy("/bin/busybox", destination / "docker" / "busybox")
    (destination / "docker" / "zoo-copy-id").write_text(uuid.uuid4().hex)
    return destination
