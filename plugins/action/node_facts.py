"""Action: the node_facts module (library/node_facts.py), with no round on the node when the preflight stage's round
already read its facts (node_preflight's ``node_facts``, handed in as ``read_by_preflight``)."""

from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    """A node round is an srun step and a Python start on every node: the preflight
    stage's round reads the facts too, and the preparation stage hands them on from here, on the controller."""

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        read = self._task.args.get("read_by_preflight")
        if read is None:
            return dict(result, **self._execute_module(module_name="node_facts", task_vars=task_vars))
        read = dict(read)
        for warning in read.pop("warnings", []):
            self._display.warning(warning)
        return dict(result, **read)
