"""Filter: the image ID a node announces at the image-ready barrier (the build stage)."""

from ansible.errors import AnsibleFilterError


def _image_id(result, what):
    """The ``image_id`` of a registered module result, or an error naming the task that should have given it."""
    image_id = (result or {}).get("image_id") if isinstance(result, dict) else None
    if not image_id:
        raise AnsibleFilterError(
            f"no image ID from {what}: that task was skipped or failed, so this node has nothing to announce at "
            f"the barrier"
        )
    return image_id


def announced_image_id(node_rank, registry_mode=False, handed=None, primary_image=None, pulled=None):
    """The image ID ``node_rank`` announces, always ``docker image inspect``'s ``.Id``: what this node's handoff
    published or loaded (a worker that rebuilt the image: rank 0's, its build fingerprint checked), or in registry
    mode rank 0's ``primary_image`` and a worker what it ``pulled``."""
    try:
        rank = int(node_rank)
    except (TypeError, ValueError):
        raise AnsibleFilterError(f"node_rank must be a whole number, not {str(node_rank)[:40]!r}") from None
    if registry_mode:
        if rank == 0:
            return _image_id(primary_image, "rank 0's registry_pull (primary_image)")
        return _image_id(pulled, "this worker's registry_pull (pulled)")
    if rank == 0:
        return _image_id(handed, "rank 0's publish (handed_image)")
    if isinstance(handed, dict) and handed.get("action_taken") == "rebuilt":
        return _image_id({"image_id": handed.get("rank0_image_id")}, "rank 0's announcement (handed_image)")
    return _image_id(handed, "this worker's load (handed_image)")


class FilterModule:
    def filters(self):
        return {"announced_image_id": announced_image_id}
