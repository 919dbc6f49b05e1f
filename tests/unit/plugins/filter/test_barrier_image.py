"""The image ID a node announces at the barrier: always an ID a node's daemon gave, chosen by mode and rank."""

import pytest
from ansible.errors import AnsibleFilterError

from plugins.filter.barrier_image import announced_image_id

RANK0_ID = "sha256:" + "a" * 64
WORKER_ID = "sha256:" + "b" * 64
REBUILT_ID = "sha256:" + "c" * 64
SKIPPED = {"changed": False, "skipped": True, "skip_reason": "Conditional result was False"}


def test_rank_0_announces_the_image_it_published():
    assert (
        announced_image_id(0, False, handed={"image_id": RANK0_ID}, primary_image=SKIPPED, pulled=SKIPPED) == RANK0_ID
    )


def test_a_worker_announces_the_image_it_loaded():
    assert (
        announced_image_id(
            2,
            False,
            handed={"image_id": WORKER_ID, "action_taken": "loaded", "rank0_image_id": RANK0_ID},
            primary_image=SKIPPED,
            pulled=SKIPPED,
        )
        == WORKER_ID
    )


def test_a_worker_that_rebuilt_the_image_announces_rank_0s_id():
    assert (
        announced_image_id(
            "1", False, handed={"image_id": REBUILT_ID, "action_taken": "rebuilt", "rank0_image_id": RANK0_ID}
        )
        == RANK0_ID
    )


def test_registry_mode_rank_0_announces_the_image_its_pull_pinned():
    assert announced_image_id(0, True, handed=SKIPPED, primary_image={"image_id": RANK0_ID}, pulled=SKIPPED) == RANK0_ID


def test_registry_mode_a_worker_announces_the_image_it_pulled():
    assert (
        announced_image_id(
            1,
            True,
            handed=SKIPPED,
            primary_image={"image_id": RANK0_ID},
            pulled={"image_id": WORKER_ID},
        )
        == WORKER_ID
    )


@pytest.mark.parametrize(
    "rank, registry_mode, what",
    [(0, False, "handed_image"), (1, False, "handed_image"), (0, True, "primary_image"), (1, True, "pulled")],
)
def test_a_skipped_result_is_an_error_naming_the_task(rank, registry_mode, what):
    with pytest.raises(AnsibleFilterError) as error:
        announced_image_id(rank, registry_mode, handed=SKIPPED, primary_image=SKIPPED, pulled=SKIPPED)
    assert f"({what})" in str(error.value)


def test_a_rank_that_is_not_a_number_is_an_error():
    with pytest.raises(AnsibleFilterError, match="node_rank must be a whole number"):
        announced_image_id("zero", False, handed={"image_id": RANK0_ID})
