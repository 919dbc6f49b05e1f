"""Filters of the node play: what is wrong with its shape (node_play_guards): the nodes it covers, at once, and its
mode; the argument spec of every stage it runs, checked once."""

import os

import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import MODES, PULL


def node_play_problems(mode, allocation_nodes, play_hosts, play_batch, forks, pull_node="", barrier_token_set=False):
    """Messages saying what to fix, each naming the problem; empty when the play may run. Push mode: the play covers
    the allocation's nodes, all at once, a fork each, rank 0 first; pull mode: ``pull_node`` alone, with the run's
    barrier token."""
    nodes, hosts = list(allocation_nodes), list(play_hosts)
    if mode not in MODES:
        return [f"mode is {str(mode)[:40]!r}: use push (one controller drives every node) or pull (one per node)."]
    if mode == PULL:
        if hosts == [pull_node] and barrier_token_set:
            return []
        where = pull_node or "SLURMD_NODENAME is unset: not inside a SLURM step"
        return [
            f"mode=pull runs one ansible-playbook per node, each against its own node ({where}), with the run's "
            f"MAD_BARRIER_TOKEN in the environment; this play runs on {', '.join(hosts)}. Start it with "
            "`slurm-multi submit --mode pull` or `slurm-multi run --mode pull`, which start the pull step for you."
        ]
    problems = []
    if sorted(hosts) != sorted(nodes):
        problems.append(
            f"This play must run on every node of the allocation ({', '.join(nodes)}) but runs on "
            f"{', '.join(hosts)}. Drop --limit: a multi-node run cannot leave a node out."
        )
    elif hosts and nodes and hosts[0] != nodes[0]:
        problems.append(
            f"Rank 0 ({nodes[0]}) must be the play's first host, but {hosts[0]} is: rank 0's own tasks run once, "
            "on the first host. Write the play's hosts as `primary:workers`."
        )
    if len(list(play_batch)) != len(nodes):
        problems.append(
            f"The play runs in batches of {len(list(play_batch))} host(s) but a multi-node run needs all "
            f"{len(nodes)} at once: remove `serial` from the play."
        )
    if int(forks) < len(nodes):
        problems.append(
            f"ansible_forks is {forks} but the allocation has {len(nodes)} nodes: tasks that wait for the other "
            f"nodes would wait forever. Run with -f {len(nodes)} (or more)."
        )
    return problems


def stages_argument_options(roles, roles_dir):
    """The options of every named role's argument spec (``<roles_dir>/<role>/meta/argument_specs.yml``), as one spec:
    the play checks its stages' inputs in one validation, not one per role (an option several roles take, such as
    results_dir, is checked once). Two roles that take one option differently (its type, default, choices: anything
    but its description) are an error naming both."""
    options, owner = {}, {}
    for role in roles:
        path = os.path.join(roles_dir, role, "meta", "argument_specs.yml")
        try:
            with open(path, encoding="utf-8") as handle:
                spec = yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            role_options = spec["argument_specs"]["main"].get("options") or {}
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:
            raise AnsibleFilterError(f"cannot read the argument spec of role {role} ({path}): {exc}") from None
        for name, option in role_options.items():
            if name in options and _without_description(options[name]) != _without_description(option):
                raise AnsibleFilterError(
                    f"roles {owner[name]} and {role} take option {name} differently ({path}): "
                    "make their argument specs agree on everything but its description"
                )
            options.setdefault(name, option)
            owner.setdefault(name, role)
    return options


def _without_description(option):
    return {key: value for key, value in option.items() if key != "description"}


class FilterModule:
    def filters(self):
        return {"node_play_problems": node_play_problems, "stages_argument_options": stages_argument_options}
