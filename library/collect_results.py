#!/usr/bin/python
"""Ansible module: decide a multi-node job's verdict and write its perf record (localhost); the pipeline runs its
action plugin of the same name in Ansible's own worker, both doing module_utils/results/collect_task.py's work."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: collect_results
short_description: Decide a multi-node job's verdict and write its perf record
extends_documentation_fragment:
  - slurm_multi.pipeline.module_attributes
description:
  - Runs on localhost after the run stage (whatever its outcome), with the slurm-multi venv (it needs pandas).
    Reads every node's C(status.json), C(run.log) and results CSVs, decides the attempt's SUCCESS or FAILURE and
    writes its record, the job's record and C(perf.csv) under a lock (docs/contracts.md, docs/results.md).
  - A FAILURE verdict is data, not a module failure; use the returned RV(status) to fail the play.
version_added: "0.1.0"
author:
  - slurm-multi maintainers
options:
  results_dir:
    description: The results directory shared by all nodes (group_vars C(results_dir)).
    type: path
    required: true
  job_id:
    description: The SLURM job ID whose results to collect.
    type: str
    required: true
  attempt:
    description: The attempt to collect - C(SLURM_RESTART_COUNT) of the run (unset - the job's last attempt).
    type: int
  model:
    description:
      - The model card's fields; C(name) names the perf rows, C(multiple_results) the results CSV, the others fill the
        row.
    type: dict
    default: {}
  nodes:
    description:
      - The allocation's nodes in rank order (empty - the job's C(run_context.json) hosts, else the node dirs present).
    type: list
    elements: str
    default: []
  force:
    description: Decide and write the attempt's record again even when it already has one.
    type: bool
    default: false
  container_runtime:
    description:
      - The job's C(container_runtime) setting; the record names it when no node's C(status.json) names the runtime
        the job ran under (empty - unknown).
    type: str
    default: ""
attributes:
  check_mode:
    support: full
    details:
      - Decides the verdict and returns it; writes no record and no perf.csv row.
  diff_mode:
    support: none
notes:
  - Only the first 1000 perf rows are returned (O(perf_rows_total) has the count); the record holds them all.
"""

EXAMPLES = r"""
- name: Collect the job's results into its perf record
  collect_results:
    results_dir: "{{ results_dir }}"
    job_id: "{{ slurm_job_id }}"
    model: "{{ model_card }}"
    nodes: "{{ groups['all'] }}"
  register: collected
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
status:
  description: The job's verdict.
  returned: always
  type: str
  sample: SUCCESS
reason:
  description: Why; for a FAILURE it names the root-cause node(s) first, then those that only stopped.
  returned: always
  type: str
  sample: "node2 (rank 1): container exited with code 1; node1 (rank 0): stopped because rank 1 failed"
record_path:
  description: The attempt's record (its completion marker).
  returned: always
  type: str
  sample: /home/alice/slurm-multi-results/records/4242/attempt-0.json
job_record_path:
  description: The job's record (its last attempt's, naming every attempt).
  returned: always
  type: str
  sample: /home/alice/slurm-multi-results/records/4242.json
attempt:
  description: The attempt collected.
  returned: always
  type: int
  sample: 0
perf_rows:
  description: The job's perf rows (model, performance, metric, status), at most 1000.
  returned: always
  type: list
  elements: dict
  sample: [{"model": "primus_llama", "performance": "10123.4", "metric": "tok/s/GPU", "status": "SUCCESS"}]
perf_rows_total:
  description: How many perf rows the record holds.
  returned: always
  type: int
  sample: 1
per_node:
  description: Each node's verdict, keyed by node name.
  returned: always
  type: dict
  sample: {"node2": {"rank": 1, "status": "FAILURE", "reason": "container exited with code 1", "root_cause": true}}
metric_source:
  description: Where the metric came from, relative to results_dir; empty when none was found.
  returned: always
  type: str
  sample: 4242/attempt-0/nodes/node3/run.log
results_csv_candidates:
  description: Every results CSV considered, with its row counts and why it was skipped, if it was.
  returned: always
  type: list
  elements: dict
  sample: [{"path": "/r/4242/attempt-0/nodes/node1/perf.csv", "rows": 0, "non_empty_rows": 0, "selected": false,
            "skipped": null}]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.module_runner import run_reporting_unexpected_errors
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.collect_task import (
    ARGUMENT_SPEC,
    collect_results,
)


def run_module(module: AnsibleModule) -> None:
    """Collect the job's attempt into its record and report the verdict; an expected failure fails with why."""
    result, warnings = collect_results(module.params, module.check_mode)
    for warning in warnings:
        module.warn(warning)
    module.exit_json(**result)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_reporting_unexpected_errors(module, run_module, "collect_results")


if __name__ == "__main__":
    main()
