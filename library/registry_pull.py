#!/usr/bin/python
"""Ansible module: make this node hold the image rank 0 pushed, by digest (logic in module_utils/image/registry.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: registry_pull
short_description: Pull an image by digest in registry mode and report its image ID
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
  - slurm_multi.pipeline.docker_cli
description:
  - Registry mode - makes this node's daemon hold the image rank 0 pushed, by digest (nothing is pulled when it
    already does), so another push to the same tag cannot change what a node runs. A tag is pulled and
    RV(reference) is the digest the pull got.
  - With O(credentials_file), the pull runs logged in through a private Docker config dir removed right after.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  image:
    description:
      - The image to hold - C(<repository>@sha256:<digest>), or C(<repository>:<tag>) on rank 0 when the manifest names
        no digest.
    type: str
    required: true
  credentials_file:
    description: MAD's C(credential.json) (yours, mode 0600); its entry for O(image)'s host is the login.
    type: path
attributes:
  check_mode:
    support: full
    details:
      - Says whether it would pull; a tag is not resolved (RV(reference) and RV(image_id) are null).
  diff_mode:
    support: none
notes:
  - C(changed) is true when an image was downloaded.
"""

EXAMPLES = r"""
- name: Hold rank 0's image by the digest it pushed
  registry_pull:
    image: 127.0.0.1:17500/bench@sha256:8cf41ec31bd1dd1b8eb3b613452861f9d1dc55f2e26083684e8c7f7b79d35f61
  register: pulled

- name: Pull a manifest's tag once on rank 0 and learn its digest
  registry_pull:
    image: docker.io/rocm/pytorch-private:ci-pyt_vllm_pyt_vllm.ubuntu.amd
  register: primary_image
  when: node_rank == 0
"""

RETURN = r"""
reference:
  description: The image by digest that this node now holds (null in check mode for a tag).
  returned: always
  type: str
  sample: 127.0.0.1:17500/bench@sha256:8cf41ec31bd1dd1b8eb3b613452861f9d1dc55f2e26083684e8c7f7b79d35f61
image_id:
  description: The C(.Id) of RV(reference) on this node, which it announces at the barrier (null in check mode).
  returned: always
  type: str
  sample: sha256:9b2795caec42abf84970b68e5fbdbc4541029b74df40f35e79577e632cf289a0
action:
  description: C(already-present), C(pulled), C(up-to-date) (a tag whose image the node had) or C(would-pull).
  returned: always
  type: str
  sample: pulled
step:
  description: When this node's C(load) step started and ended (epoch seconds), for the timeline.
  returned: always, but in check mode
  type: dict
  sample: {"name": "load", "start": 1764523800.12, "end": 1764523841.5}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry import (
    DEFAULT_PULL_TIMEOUT,
    pull_image,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.registry_credentials import logged_in
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors

ARGUMENT_SPEC = dict(
    image=dict(type="str", required=True),
    credentials_file=dict(type="path"),
    docker_host=dict(type="str"),
    docker_timeout=dict(type="float", default=DEFAULT_PULL_TIMEOUT),
)


def run_module(module: AnsibleModule) -> None:
    params = module.params
    # Check mode logs in nowhere. The password is registered as a no_log value: Ansible masks it in the results.
    credentials_file = None if module.check_mode else params["credentials_file"]
    with logged_in(
        credentials_file, params["image"], docker_host=params["docker_host"], on_secret=module.no_log_values.add
    ) as login_env:
        pulled = pull_image(
            params["image"],
            host=params["docker_host"],
            timeout=params["docker_timeout"],
            check_mode=module.check_mode,
            login_env=login_env,
        )
    module.exit_json(
        changed=pulled.action in ("pulled", "would-pull"),
        reference=pulled.reference,
        image_id=pulled.image_id,
        action=pulled.action,
    )


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "registry_pull", step="load", changed=False)


if __name__ == "__main__":
    main()
