#!/usr/bin/python
"""Ansible module: build (or reuse) the selected MAD model cards' images on this node; write build_manifest.json."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: build_images
short_description: Build the images of MAD model cards on this node and write build_manifest.json
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Selects a MAD model zoo's cards by tag as MAD's C(--tags) does, picks their Dockerfiles by the C(# CONTEXT)
    line against O(context), builds each image with C(docker build) on this node (no shell) and writes
    O(manifest_path) in MAD's shape (docs/images.md).
  - Images are labelled with a build fingerprint (Dockerfile, build args, context, base image IDs); an image with the
    same label is reused. Secrets come only as BuildKit secret mounts from O(secrets_file), never as build args
    (docs/secrets.md).
options:
  models_file:
    description: The zoo's C(models.json); its directory is the zoo root Dockerfile paths are relative to.
    type: path
    required: true
  tags:
    description: MAD tags selecting the cards (C(all), C(scope/tag), C(name:key=value) as in MAD).
    type: list
    elements: str
    required: true
  context:
    description:
      - The run context (MAD's context dict); its keys select among Dockerfiles, C(docker_build_arg) gives build args.
    type: dict
    default: {}
  secrets_file:
    description: The job's C(MAD_SECRETS_*) file, read only when a Dockerfile mounts such a secret.
    type: path
  buildkit_docker_cli:
    description: The docker CLI (with buildx, or Docker 20.10's) that builds Dockerfiles using C(RUN --mount).
    type: str
    default: docker
  manifest_path:
    description: Where to write build_manifest.json.
    type: path
    required: true
  build_log_dir:
    description: Directory of the build logs (C(<model>_<dockerfile stem>.build.live.log)); default the manifest's.
    type: path
  registry:
    description: Also push each image to this registry and record it by the pushed digest, which the nodes pull.
    type: str
  credentials_file:
    description:
      - MAD's C(credential.json); its entry for O(registry)'s host logs in before pushing. Unused without O(registry).
    type: path
  force_rebuild:
    description:
      - Build even when an image with the same fingerprint exists, without the build cache (e.g. a secret changed).
    type: bool
    default: false
  prebuilt_image:
    description: Run this prebuilt image (local or registry) instead of building, as MAD's C(--use-image).
    type: str
  keep_going:
    description:
      - A sweep's failed builds do not stop the others (RV(failed_builds)); the first image failing still fails the
        module.
    type: bool
    default: false
  container_runtime:
    description:
      - C(docker) builds with C(docker build); C(charliecloud) with C(ch-image), unprivileged, into one squashfs in
        O(charliecloud.cache_dir) named by its sha256 (the image ID the manifest records), reused by build fingerprint.
    type: str
    choices: [docker, charliecloud]
    default: docker
  charliecloud:
    description: With O(container_runtime=charliecloud), where and from what it builds.
    type: dict
    suboptions:
      cache_dir:
        description: The shared image cache the squashfs goes to (the node's C(MAD_DOCKER_BUILDS) overrides it).
        type: path
        required: true
      storage_dir:
        description: ch-image's node-local storage (imported bases, the tree being built); C(%u) the user's name.
        type: str
        default: /var/tmp/slurm-multi-%u/ch-image
      bases:
        description: Bases from a root filesystem tar or directory instead of a registry, C({reference - path}).
        type: dict
        default: {}
      mount_points:
        description: Container paths made in the image for the run's binds (the model's docker_mounts' targets).
        type: list
        elements: str
        default: []
  deployment_config:
    description:
      - The job's config; its deployment sections go into the manifest, C(MAD_SECRETS_*) as C(${NAME}) references.
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    details:
      - Reports which images would be built, pushed and recorded; builds, pushes and writes nothing.
  diff_mode:
    support: none
notes:
  - C(changed) is true when an image was built or pushed, or the manifest was written.
  - Several Dockerfiles fitting one card are all built, as MAD does; RV(image_id) and RV(image_name) are set only
    when exactly one image results.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
"""

EXAMPLES = r"""
- name: Build the model's image on rank 0
  build_images:
    models_file: "{{ model_zoo }}/models.json"
    tags: ["{{ model_tag }}"]
    context: {gpu_vendor: AMD, docker_build_arg: {BASE_DOCKER: "rocm/pytorch:latest"}}
    secrets_file: "{{ job_private_dir }}/secrets.env"
    manifest_path: "{{ results_dir }}/{{ slurm_job_id }}/build_manifest.json"
  register: build
  when: node_rank == 0
"""

RETURN = r"""
images:
  description: One entry per image, in build order.
  returned: always
  type: list
  elements: dict
  sample: [{"model": "dummy", "image_name": "ci-dummy_dummy.ubuntu.amd", "image_id": "sha256:0a1b2c...",
            "action": "built", "build_fingerprint": "5f0c...e1", "build_duration": 12.4, "registry_image": null}]
image_name:
  description: The local image name when exactly one image results, else null.
  returned: always
  type: str
  sample: ci-dummy_dummy.ubuntu.amd
image_id:
  description: The image ID when exactly one image results (null in check mode for an image to build).
  returned: always
  type: str
  sample: sha256:0a1b2c3d4e5f...
failed_builds:
  description: The images that failed to build with O(keep_going) (else always empty), each with the error.
  returned: always
  type: list
  elements: dict
  sample: [{"model": "dummy_broken", "image_name": "ci-dummy_broken_dummy_broken", "error": "docker build ... failed"}]
manifest_path:
  description: The manifest written (or that would be written in check mode).
  returned: always
  type: str
  sample: /shared/results/42/build_manifest.json
manifest_written:
  description: Whether the manifest's content changed (and, outside check mode, was written).
  returned: always
  type: bool
  sample: true
step:
  description: When this node's C(build) step started and ended (epoch seconds), for the timeline.
  returned: always, but in check mode
  type: dict
  sample: {"name": "build", "start": 1764523800.12, "end": 1764523841.5}
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import (
    ImageBuildError,
    ensure_image,
    plan_image_builds,
    push_images,
    record_builds,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_manifest,
    load_model_cards,
    select_model_cards,
    write_build_failures,
    write_manifest,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    normalize_registry,
    registry_image_name,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.prebuilt import one_card, prebuilt_manifest
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import DEFAULT_RUNTIME, RUNTIMES, by_name

ARGUMENT_SPEC = dict(
    models_file=dict(type="path", required=True),
    tags=dict(type="list", elements="str", required=True),
    context=dict(type="dict", default={}),
    manifest_path=dict(type="path", required=True),
    build_log_dir=dict(type="path"),
    registry=dict(type="str"),
    force_rebuild=dict(type="bool", default=False),
    deployment_config=dict(type="dict", default={}),
    secrets_file=dict(type="path"),
    credentials_file=dict(type="path"),
    buildkit_docker_cli=dict(type="str", default=SETTING_DEFAULTS["buildkit_docker_cli"]),
    prebuilt_image=dict(type="str"),
    keep_going=dict(type="bool", default=False),
    container_runtime=dict(type="str", default=DEFAULT_RUNTIME, choices=list(RUNTIMES)),
    charliecloud=dict(
        type="dict",
        options=dict(
            cache_dir=dict(type="path", required=True),
            storage_dir=dict(type="str", default=SETTING_DEFAULTS["charliecloud_storage_dir"]),
            bases=dict(type="dict", default={}),
            mount_points=dict(type="list", elements="str", default=[]),
        ),
    ),
)


def image_report(outcome, registry_images: dict, registry_images_by_digest: dict) -> dict:
    """What the module returns about one image."""
    plan = outcome.plan
    return {
        "model": plan.model["name"],
        "image_name": plan.image_name,
        "image_id": outcome.image_id,
        "dockerfile": plan.dockerfile,
        "action": outcome.action,
        "reason": outcome.reason,
        "build_fingerprint": plan.fingerprint,
        "base_images": plan.base_images,
        "build_duration": round(outcome.build_duration, 3),
        "log_file": plan.log_file,
        "registry_image": registry_images.get(plan.image_name),
        "registry_image_by_digest": registry_images_by_digest.get(plan.image_name),
    }


def build_images(module: AnsibleModule, cards, builder) -> dict:
    """Decide what to build, build or reuse it, push it, and record the manifest; returns the result. ``builder``:
    the runtime's own (runtimes' ImageBuilder), or None for Docker's build."""
    params = module.params
    registry = normalize_registry(params["registry"]) if params["registry"] is not None else None
    manifest_path = os.path.abspath(params["manifest_path"])
    zoo_root = os.path.dirname(os.path.abspath(params["models_file"]))
    log_dir = params["build_log_dir"] or os.path.dirname(manifest_path)
    plans = plan_image_builds(zoo_root, cards, params["context"], log_dir, secrets_file=params["secrets_file"])
    previous = load_manifest(manifest_path) if os.path.exists(manifest_path) else None

    outcomes, failures = [], []
    for plan in plans:
        try:
            if builder is not None:
                outcomes.append(builder.ensure(plan, params["force_rebuild"], module.check_mode))
                continue
            outcomes.append(
                ensure_image(
                    plan,
                    force_rebuild=params["force_rebuild"],
                    check_mode=module.check_mode,
                    buildkit_cli=params["buildkit_docker_cli"],
                )
            )
        except ImageBuildError as error:
            if not params["keep_going"]:
                raise
            failures.append(
                {"model": plan.model["name"], "dockerfile": plan.dockerfile, "image_name": plan.image_name,
                 "error": str(error)}
            )  # fmt: skip
    registry_images, registry_images_by_digest = {}, {}
    if registry and module.check_mode:
        registry_images = {
            outcome.plan.image_name: registry_image_name(registry, outcome.plan.image_name) for outcome in outcomes
        }
    elif registry:
        # The password is registered as a no_log value: Ansible masks it in anything this module returns.
        registry_images, registry_images_by_digest = push_images(
            outcomes, registry, params["credentials_file"], on_secret=module.no_log_values.add
        )

    manifest = record_builds(
        outcomes,
        params["context"],
        params["deployment_config"],
        previous,
        registry,
        registry_images,
        registry_images_by_digest,
    )
    for outcome in outcomes if builder is not None else ():
        manifest["built_images"][outcome.plan.image_name].update(builder.manifest_fields(outcome))
    manifest_written = manifest != previous
    if manifest_written and not module.check_mode and outcomes:
        write_manifest(manifest_path, manifest)
    if params["keep_going"] and not module.check_mode:
        write_build_failures(manifest_path, failures)
    if failures and failures[0]["image_name"] == plans[0].image_name:
        # The first image is this run's model: it cannot run. The others are built and in the manifest.
        raise ImageBuildError(failures[0]["error"])

    images = [image_report(outcome, registry_images, registry_images_by_digest) for outcome in outcomes]
    single = images[0] if len(images) == 1 else {}
    built = any(outcome.action in ("built", "would_build") for outcome in outcomes)
    return dict(
        changed=built or bool(registry_images) or manifest_written,
        images=images,
        failed_builds=failures,
        image_name=single.get("image_name"),
        image_id=single.get("image_id"),
        manifest_path=manifest_path,
        manifest_written=manifest_written,
    )


def use_prebuilt_image(module: AnsibleModule, cards) -> dict:
    """Record the prebuilt image and its card as the job's manifest; nothing is built or pushed."""
    params = module.params
    manifest_path = os.path.abspath(params["manifest_path"])
    card = one_card(cards, params["tags"], params["prebuilt_image"])
    manifest = prebuilt_manifest(card, params["prebuilt_image"], params["context"], params["deployment_config"])
    previous = load_manifest(manifest_path) if os.path.exists(manifest_path) else None
    manifest_written = manifest != previous
    if manifest_written and not module.check_mode:
        write_manifest(manifest_path, manifest)
    ((image_name, entry),) = manifest["built_images"].items()
    image = {
        "model": card["name"],
        "image_name": image_name,
        "image_id": entry["image_id"],
        "dockerfile": "",
        "action": "prebuilt",
        "reason": f"--use-image {image_name}: the prebuilt image replaces the build",
        "build_fingerprint": None,
        "base_images": None,
        "build_duration": 0,
        "log_file": "",
        "registry_image": entry.get("registry_image"),
        "registry_image_by_digest": entry.get("registry_image_by_digest"),
    }
    return dict(
        changed=manifest_written,
        images=[image],
        image_name=image_name,
        image_id=entry["image_id"],
        manifest_path=manifest_path,
        manifest_written=manifest_written,
    )


def run_module(module: AnsibleModule) -> None:
    """Build the images; an expected failure (bad card, manifest, Dockerfile, build) fails with its message."""
    params = module.params
    cards = select_model_cards(load_model_cards(params["models_file"]), params["tags"])
    zoo_root = os.path.dirname(os.path.abspath(params["models_file"]))
    # The job's runtime builds its own images, refusing what it cannot (--use-image, a registry), or Docker does.
    builder = by_name(params["container_runtime"]).builder(params, cards, zoo_root)
    result = use_prebuilt_image(module, cards) if params["prebuilt_image"] else build_images(module, cards, builder)
    module.exit_json(**result)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "build_images", step="build")


if __name__ == "__main__":
    main()
