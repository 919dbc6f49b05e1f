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
  - Reads a MAD model zoo (C(models.json) at its root, plus C(scripts/<dir>/models.json)), selects cards by tag as
    MAD's C(--tags) does, picks each card's Dockerfiles by their C(# CONTEXT) line against O(context), and builds one
    image per card and Dockerfile with C(docker build) on this node (rank 0), no shell involved.
  - The image is named as MAD names it (C(ci-<model>_<dockerfile stem>)) and labelled
    C(slurm-multi.build-fingerprint=<sha256>) over the Dockerfile, the build args, the build context and the image ID
    of every base image its C(FROM) lines name, as this node's daemon resolves it (a missing base is pulled first,
    into the build log). An image with the same label is reused; a base pulled or rebuilt under the same tag has a
    new ID, so the image is built again. No C(--pull) - a tag moved only in its registry counts once pulled here.
  - The build context is the zoo's C(docker/) directory, or the card's C(dockercontext), as in MAD.
  - Secrets never go in as build args (Docker records them in the image's history). A C(MAD_SECRETS_*) build arg, or
    one referring to C(${MAD_SECRETS_*}), fails with the fix - a BuildKit secret mount
    (C(RUN --mount=type=secret,id=MAD_SECRETS_HFTOKEN ...)), whose value comes from O(secrets_file) through a 0600
    file in a private node-local dir removed after the build (never argv or environment).
  - A Dockerfile with C(RUN --mount) is built with BuildKit (C(DOCKER_BUILDKIT=1)) by O(buildkit_docker_cli).
  - Writes O(manifest_path) in MAD's shape (C(built_images), C(built_models), C(context), C(deployment_config)),
    with C(image_id), C(build_fingerprint) and C(base_images) in each image entry; C(base_docker) and C(docker_sha)
    as madengine fills them. The file is replaced atomically, and only when its content changes.
  - The build log of each image is streamed to O(build_log_dir).
options:
  models_file:
    description: The zoo's C(models.json); its directory is the zoo root Dockerfile paths are relative to.
    type: path
    required: true
  tags:
    description:
      - MAD tags selecting the cards; a tag matches a card whose name equals it or whose C(tags) contain it.
      - C(all) selects every card; C(scope/tag) selects within C(scripts/<scope>/); C(name:key=value) appends
        C( --key value) to the card's C(args).
    type: list
    elements: str
    required: true
  context:
    description:
      - >-
        The run context (MAD's context dict), e.g. C({"gpu_vendor": "AMD", "guest_os": "UBUNTU",
        "docker_build_arg": {"BASE_DOCKER": "rocm/pytorch:latest"}}).
      - Its keys select among a card's Dockerfiles; C(docker_build_arg) becomes build args (no secrets there).
    type: dict
    default: {}
  secrets_file:
    description:
      - The job's C(MAD_SECRETS_*) file (C(KEY=VALUE) lines, yours, mode 0600; written by C(slurm-multi submit)).
        Read only when a Dockerfile mounts a C(MAD_SECRETS_*) secret.
    type: path
  buildkit_docker_cli:
    description:
      - The docker CLI that builds Dockerfiles using C(RUN --mount) - one with the buildx component, or Docker 20.10's.
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
    description:
      - Also tag and push each image to this registry and record it by the digest the push reported
        (C(registry_image_by_digest)), which nodes pull, so a later push to the same tag cannot change what they run.
      - Normalized as C(--registry) is (C(ns/repo) means C(docker.io/ns/repo)); one tag per image
        (C(<repository>:<local image name>)). Malformed values fail before anything is built.
    type: str
  credentials_file:
    description:
      - MAD's C(credential.json) (yours, mode 0600); its entry for the O(registry)'s host (C(username) and
        C(password) or C(token)) logs in before pushing, the password on stdin, in a private Docker config dir
        removed afterwards. Unused without O(registry).
    type: path
  force_rebuild:
    description:
      - Build even when an image with the same fingerprint exists, without the build cache - needed when a mounted
        secret changed (neither the fingerprint nor the build cache covers secret values).
    type: bool
    default: false
  prebuilt_image:
    description:
      - Run this prebuilt image instead of building (MAD's C(--use-image)); O(tags) still select the one card.
      - A local image must be on this node's daemon; its ID is recorded. A registry image (C(host/repository:tag),
        C(repository@sha256:...)) is recorded as C(registry_image) for every node to pull by digest.
    type: str
  keep_going:
    description:
      - For a sweep - an image that fails to build does not stop the others; the failures go to
        C(build_failures.json) beside the manifest and RV(failed_builds). The module still fails when the first
        image fails (the model this run is for).
    type: bool
    default: false
  deployment_config:
    description:
      - The job's config; its deployment sections are written as the manifest's C(deployment_config), each
        C(MAD_SECRETS_*) as its C(${NAME}) reference.
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
    context:
      gpu_vendor: AMD
      guest_os: UBUNTU
      docker_build_arg:
        BASE_DOCKER: rocm/pytorch:latest
    # The Dockerfile reads the token with: RUN --mount=type=secret,id=MAD_SECRETS_HFTOKEN ...
    secrets_file: "{{ job_private_dir }}/secrets.env"
    manifest_path: "{{ results_dir }}/{{ slurm_job_id }}/build_manifest.json"
  register: build
  when: node_rank == 0

- name: Build and push to a registry
  build_images:
    models_file: /shared/MAD/models.json
    tags: [pyt_vllm]
    context: {gpu_vendor: AMD}
    manifest_path: /shared/MAD/build_manifest.json
    registry: rocm/pytorch-private
"""

RETURN = r"""
images:
  description: One entry per image, in build order.
  returned: always
  type: list
  elements: dict
  sample:
    - model: dummy
      image_name: ci-dummy_dummy.ubuntu.amd
      image_id: sha256:0a1b2c...
      dockerfile: /shared/MAD/docker/dummy.ubuntu.amd.Dockerfile
      action: built
      reason: no image ci-dummy_dummy.ubuntu.amd on this node
      build_fingerprint: 5f0c...e1
      base_images: {"rocm/pytorch:latest": "sha256:9d3e..."}
      build_duration: 12.4
      log_file: /shared/results/42/dummy_dummy.ubuntu.amd.build.live.log
      registry_image: null
      registry_image_by_digest: null
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
  sample:
    - model: dummy_broken
      dockerfile: /shared/MAD/docker/dummy_broken.Dockerfile
      image_name: ci-dummy_broken_dummy_broken
      error: docker build of ci-dummy_broken_dummy_broken from ... failed (exit 1); ...
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


def build_images(module: AnsibleModule) -> dict:
    """Decide what to build, build or reuse it, push it, and record the manifest; returns the result."""
    params = module.params
    registry = normalize_registry(params["registry"]) if params["registry"] is not None else None
    manifest_path = os.path.abspath(params["manifest_path"])
    cards = select_model_cards(load_model_cards(params["models_file"]), params["tags"])
    zoo_root = os.path.dirname(os.path.abspath(params["models_file"]))
    log_dir = params["build_log_dir"] or os.path.dirname(manifest_path)
    plans = plan_image_builds(zoo_root, cards, params["context"], log_dir, secrets_file=params["secrets_file"])
    previous = load_manifest(manifest_path) if os.path.exists(manifest_path) else None

    outcomes, failures = [], []
    for plan in plans:
        try:
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


def use_prebuilt_image(module: AnsibleModule) -> dict:
    """Record the prebuilt image and its card as the job's manifest; nothing is built or pushed."""
    params = module.params
    manifest_path = os.path.abspath(params["manifest_path"])
    cards = select_model_cards(load_model_cards(params["models_file"]), params["tags"])
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
    result = use_prebuilt_image(module) if module.params["prebuilt_image"] else build_images(module)
    module.exit_json(**result)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "build_images", step="build")


if __name__ == "__main__":
    main()
