"""tests.support.ansible.task_results: the per-host results the lab tests read from `ansible-playbook -v`."""

from tests.support.ansible import task_results

# The lines as ansible-core's default callback prints them with the json result format, one line per result: a
# host's own, and a run-once loop's items, each delegated to the node it hands facts to.
OUTPUT = """\
TASK [build : Hand rank 0's image to every node through the shared tar cache] **
changed: [node1] => {"action_taken": "published", "changed": true}
ok: [node2] => {"action_taken": "loaded", "changed": false, "layers_loaded": 1}

TASK [build : Hand on the image each node holds and the ID it announces] *******
ok: [node1] => (item=node1) => {"ansible_facts": {"node_image": {"image_id": "sha256:aa"}}, "item": "node1"}
ok: [node1 -> node2] => (item=node2) => {"ansible_facts": {"node_image": {"image_id": "sha256:bb"}}, "item": "node2"}
fatal: [node3]: FAILED! => {"msg": "not a result this reads"}
"""


def test_each_hosts_result_and_each_delegated_loop_items_under_the_node_it_went_to():
    results = task_results(OUTPUT)
    handoff = results["Hand rank 0's image to every node through the shared tar cache"]
    assert handoff == {
        "node1": {"action_taken": "published", "changed": True},
        "node2": {"action_taken": "loaded", "changed": False, "layers_loaded": 1},
    }
    hand_on = results["Hand on the image each node holds and the ID it announces"]
    assert {node: result["ansible_facts"]["node_image"]["image_id"] for node, result in hand_on.items()} == {
        "node1": "sha256:aa",
        "node2": "sha256:bb",
    }
