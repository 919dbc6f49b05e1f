#!/usr/bin/python
"""Ansible module: publish an image to the shared tar cache (rank 0), load it from there (workers), or prune it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: image_cache
short_description: Hand a locally built image from rank 0 to every worker through a shared, content-addressed tar cache
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
  - slurm_multi.pipeline.docker_cli
description:
  - Hands rank 0's locally built image to the workers through a cache dir every node sees - O(state=published)
    saves it, O(state=loaded) loads it into a worker's daemon, O(state=pruned) removes old entries (docs/images.md).
  - An entry is C(<hex>.tar) plus its commit marker C(<hex>.json), written last, and no file is ever replaced (no
    ESTALE on NFS); a load is checked layer by layer against the announced image ID, so a torn tar loads nothing.
  - A cache dir other users can write to, or owned by neither you nor root, is refused.
options:
  state:
    description:
      - C(published) puts O(image) into the cache unless its entry is there whole, storing only the layers the cache
        lacks when it can (RV(not_pushed), RV(taught)).
      - C(loaded) makes this node's daemon hold O(image_id) from the cache entry, or with O(rebuild) by building it.
      - C(pruned) removes entries older than O(max_age_days) beyond the newest O(keep), and stale temporary files.
    type: str
    required: true
    choices: [published, loaded, pruned]
  image:
    description:
      - With C(published), the image to publish (required); with C(loaded), a tag that must point at O(image_id)
        afterwards.
    type: str
  image_id:
    description: With C(loaded), the image ID (C(sha256:<64 hex>)) rank 0 published; required unless O(announce_dir).
    type: str
  announce_dir:
    description:
      - The run's attempt dir - C(published) announces the image's ID there, C(loaded) without O(image_id) waits for it.
    type: path
  rank0_node:
    description: Rank 0's node (its heartbeat is in its node dir under O(announce_dir)); required with O(announce_dir).
    type: str
  heartbeat:
    description:
      - What shows rank 0 alive while workers wait - its ansible-playbook's (C(playbook), pull mode) or this publish's
        (C(module)).
    type: str
    choices: [playbook, module]
    default: playbook
  heartbeat_stale:
    description: Seconds rank 0's heartbeat may stand still before a waiting worker gives it up; 0 watches none.
    type: float
    default: 0
  cache_dir:
    description: The cache dir, on storage every node sees (the node's C(MAD_DOCKER_BUILDS) overrides it); created 0700.
    type: path
  marker_wait:
    description: With C(loaded), how long to wait for an entry's commit marker (network filesystems show files late).
    type: float
    default: 10.0
  rebuild:
    description:
      - With C(loaded), the opt-in fallback when there is no entry - build the image from rank 0's build manifest,
        checked by its fingerprint.
    type: dict
    suboptions:
      dockerfile:
        description: The Dockerfile rank 0 built from.
        type: path
        required: true
      context:
        description: The build context directory.
        type: path
        required: true
      tag:
        description: The image name to build (rank 0's).
        type: str
        required: true
      build_fingerprint:
        description: Rank 0's build fingerprint (the manifest's C(build_fingerprint)).
        type: str
        required: true
      build_args:
        description: The build args, C(NAME) to value.
        type: dict
        default: {}
      log_dir:
        description: Where the build log goes (the node's dir in the attempt); owner and group only, secrets masked.
        type: path
        required: true
      secrets_file:
        description: The job's C(MAD_SECRETS_*) file, for the secrets the Dockerfile mounts.
        type: path
      buildkit_docker_cli:
        description: The docker CLI that builds a Dockerfile using C(RUN --mount) (BuildKit); see C(build_images).
        type: str
        default: docker
  teach_digests:
    description:
      - With C(published), teach this node's daemon registry digests for layers of a loaded or imported base
        (RV(taught)).
    type: bool
    default: true
  keep:
    description: With C(pruned), how many of the newest committed entries are kept whatever their age.
    type: int
    default: 5
  max_age_days:
    description: With C(pruned), the age (of the commit marker) beyond which an entry not among the newest O(keep) goes.
    type: float
    default: 7.0
attributes:
  check_mode:
    support: full
    details:
      - Decides what would happen (save, load, tag, rebuild, prune) and does none of it, nor creates the cache dir.
  diff_mode:
    support: none
notes:
  - The directory is checked on every node that uses it; C(chmod go-w DIR) fixes the permission refusal.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
"""

EXAMPLES = r"""
- name: Hand rank 0's image to every node in one task (rank 0 publishes and announces, the workers load it)
  image_cache:
    state: "{{ 'published' if node_rank == 0 else 'loaded' }}"
    image: ci-dummy_dummy.ubuntu.amd
    cache_dir: "{{ image_cache_dir }}"
    announce_dir: "{{ attempt_dir }}"
    rank0_node: "{{ groups['primary'][0] }}"

- name: Remove entries older than a week beyond the newest five
  image_cache:
    state: pruned
    cache_dir: "{{ image_cache_dir }}"
  run_once: true
"""

RETURN = r"""
action_taken:
  description:
    - C(saved), C(pushed), C(loaded), C(rebuilt), C(tagged), C(already-present), C(pruned) or C(none); in check mode,
      what would be.
  returned: always
  type: str
  sample: loaded
image_id:
  description: The image's ID on this node's daemon (a rebuilt image has its own ID); null for C(pruned).
  returned: always
  type: str
  sample: sha256:8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0
entry:
  description: The entry's tar; null when no entry was used (already present, rebuilt, pruned).
  returned: always
  type: str
  sample: /shared/docker-builds/8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0.tar
bytes:
  description: Bytes of the tar saved, of the blobs a push wrote, or that a load read; 0 when none.
  returned: always
  type: int
  sample: 209715200
rank0_image_id:
  description: The image ID rank 0 announced, which a worker must hold at the barrier (a rebuilt image has its own).
  returned: when state=loaded waited for the announcement in O(announce_dir)
  type: str
  sample: sha256:8af4f094b514f8206fb0759558a1b7ec2a7683f6596e67ecbab51f0edbc15bf0
not_pushed:
  description: Why a publish saved the whole image where it tried to push only the layers the cache lacked.
  returned: when state=published tried a push and saved instead
  type: str
  sample: this daemon knows layer sha256:6283... by no registry digest (docker load, import)
taught:
  description:
    - True when this publish taught the daemon registry digests for a loaded or imported base (later publishes push only
      their layers).
  returned: when state=published taught the daemon
  type: bool
  sample: true
not_taught:
  description: Why the daemon could not be taught such digests (the publish itself succeeded).
  returned: when state=published tried to teach the daemon and could not
  type: str
  sample: "the pull from this node's loopback failed: ..."
layers_published:
  description: How many layers a C(pushed) publish wrote as blobs (the others were in the cache already).
  returned: when state=published pushed
  type: int
  sample: 1
layers_loaded:
  description: How many layers a load took from the entry (the daemon held the others); null for a whole tar.
  returned: when state=loaded loaded an entry
  type: int
  sample: 1
seconds:
  description: Time the module's work took.
  returned: always
  type: float
  sample: 2.41
cache_dir:
  description: The cache directory used (after C(MAD_DOCKER_BUILDS) overrode the option, if set).
  returned: always
  type: str
  sample: /shared/docker-builds
build_fingerprint:
  description: With a rebuild, the fingerprint the image carries.
  returned: when the rebuild fallback ran
  type: str
  sample: 5f0c3d...e1
build_log:
  description: With a rebuild that built, its build log.
  returned: when an image was rebuilt
  type: str
  sample: /tmp/ci-dummy_dummy.ubuntu.amd_dummy.ubuntu.amd.build.live.log
removed:
  description: With C(pruned), the files removed (or, in check mode, that would be).
  returned: when state is pruned
  type: list
  elements: str
  sample: [/shared/docker-builds/0b1c...json, /shared/docker-builds/0b1c...tar]
reason:
  description: In check mode, why a publish would save.
  returned: when a publish would save in check mode
  type: str
  sample: the cache has no entry for this image
step:
  description: When this node's C(publish) or C(load) step started and ended (epoch seconds), for the timeline.
  returned: always, but in check mode
  type: dict
  sample: {"name": "load", "start": 1764523800.12, "end": 1764523841.5}
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import AnnouncementError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    DEFAULT_DOCKER_TIMEOUT,
    DEFAULT_MARKER_WAIT,
    CacheDirectory,
    CacheResult,
    prune_entries,
    resolve_cache_dir,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.rebuild import RebuildRecipe
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.handoff import (
    Rank0,
    load_announced,
    publish_and_announce,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.liveness import HEARTBEATS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.steps import step_record
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors

ARGUMENT_SPEC = dict(
    state=dict(type="str", required=True, choices=["published", "loaded", "pruned"]),
    image=dict(type="str"),
    image_id=dict(type="str"),
    cache_dir=dict(type="path"),
    marker_wait=dict(type="float", default=DEFAULT_MARKER_WAIT),
    rebuild=dict(
        type="dict",
        options=dict(
            dockerfile=dict(type="path", required=True),
            context=dict(type="path", required=True),
            tag=dict(type="str", required=True),
            build_fingerprint=dict(type="str", required=True),
            build_args=dict(type="dict", default={}),
            log_dir=dict(type="path", required=True),
            secrets_file=dict(type="path"),
            buildkit_docker_cli=dict(type="str", default=SETTING_DEFAULTS["buildkit_docker_cli"]),
        ),
    ),
    teach_digests=dict(type="bool", default=SETTING_DEFAULTS["image_cache_teach_digests"]),
    keep=dict(type="int", default=SETTING_DEFAULTS["image_cache_keep"]),
    max_age_days=dict(type="float", default=float(SETTING_DEFAULTS["image_cache_max_age_days"])),
    announce_dir=dict(type="path"),
    rank0_node=dict(type="str"),
    heartbeat=dict(type="str", default="playbook", choices=list(HEARTBEATS)),
    heartbeat_stale=dict(type="float", default=0),
    docker_host=dict(type="str"),
    docker_timeout=dict(type="float", default=DEFAULT_DOCKER_TIMEOUT),
)

# The timeline step each state is (module_utils/results/timeline.py); pruning is none.
STEPS_BY_STATE = {"published": "publish", "loaded": "load"}

REQUIRED_IF = [("state", "published", ["image"])]
REQUIRED_BY = {"announce_dir": ("rank0_node", "image")}


def run_module(module: AnsibleModule) -> None:
    """Publish, load or prune as `state` asks, and report what was done."""
    params = module.params
    cache_dir = resolve_cache_dir(params["cache_dir"])
    cache = CacheDirectory(cache_dir, docker_host=params["docker_host"], docker_timeout=params["docker_timeout"])
    announced = params["state"] == "published" or (params["state"] == "loaded" and not params["image_id"])
    if params["announce_dir"] and announced:
        hand_off(module, cache, cache_dir)
    if params["state"] == "loaded" and not params["image_id"]:
        module.fail_json(msg="state=loaded needs image_id (rank 0's image), or announce_dir to wait for rank 0's")
    if params["state"] == "published":
        outcome = publish_image(cache, params["image"], check_mode=module.check_mode, teach=params["teach_digests"])
    elif params["state"] == "loaded":
        rebuild = RebuildRecipe.from_dict(params["rebuild"]) if params["rebuild"] else None
        outcome = load_image(
            cache,
            params["image_id"],
            image=params["image"],
            marker_wait=params["marker_wait"],
            rebuild=rebuild,
            check_mode=module.check_mode,
        )
    else:
        outcome = prune_entries(cache, params["keep"], params["max_age_days"], check_mode=module.check_mode)
    module.exit_json(**outcome.as_dict(), cache_dir=cache_dir)


def hand_off(module: AnsibleModule, cache: CacheDirectory, cache_dir: str) -> None:
    """The handoff in one task (module_utils/image/handoff.py): rank 0 publishes and announces, a worker waits for
    the announcement and loads what it names. Each step's time starts when its own work does."""
    params = module.params
    rank0 = Rank0(params["announce_dir"], params["rank0_node"], params["heartbeat"], params["heartbeat_stale"])
    if params["state"] == "published":
        if module.check_mode:
            module.exit_json(**publish_image(cache, params["image"], check_mode=True).as_dict(), cache_dir=cache_dir)
        outcome, announced = publish_and_announce(cache, params["image"], rank0, params["teach_digests"])
        # The publish step ends with the announcement: a lesson after it runs beside the workers' loads.
        step = dict(step_record(announced - outcome.seconds, announced), name="publish")
        module.exit_json(**outcome.as_dict(), cache_dir=cache_dir, step=step)
    if module.check_mode:
        # Rank 0 announces nothing in check mode: what this node holds under the name is what it would run.
        held = cache.image_id_of(params["image"])
        outcome = CacheResult("already-present" if held else "loaded", held is None, held)
        module.exit_json(
            **outcome.as_dict(),
            rank0_image_id=held,
            cache_dir=cache_dir,
            msg="check mode: would wait for rank 0's announcement in announce_dir and load the image it names",
        )
    rebuild = RebuildRecipe.from_dict(params["rebuild"]) if params["rebuild"] else None
    try:
        outcome, announcement = load_announced(cache, params["image"], rank0, params["marker_wait"], rebuild)
    except AnnouncementError as error:
        module.fail_json(msg=str(error), aborted_by_rank=error.aborted_by_rank)
    # The load's step starts once rank 0 announced: the wait before it is rank 0's publish, not this load.
    step = dict(step_record(time.time() - outcome.seconds), name="load")
    module.exit_json(**outcome.as_dict(), cache_dir=cache_dir, rank0_image_id=announcement["image_id"], step=step)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC, required_if=REQUIRED_IF, required_by=REQUIRED_BY, supports_check_mode=True
    )
    run_reporting_unexpected_errors(
        module, run_module, "image_cache", step=lambda module: STEPS_BY_STATE.get(module.params["state"])
    )


if __name__ == "__main__":
    main()
