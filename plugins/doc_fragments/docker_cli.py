"""The options of every custom module that drives the docker CLI (module_utils/docker_cli.py): which daemon, how long.

ansible-core 2.19 applies fragments to DOCUMENTATION only (ansible/ansible#72635), so the `step` return each timed
module carries stays written out in its RETURN, held alike by tests/test_static_checks.py.
"""


class ModuleDocFragment:
    """`extends_documentation_fragment: docker_cli` in a module's DOCUMENTATION; its argument spec takes the same two
    options (tests/test_static_checks.py holds each module's rendered options equal to its argument_spec)."""

    DOCUMENTATION = r"""
options:
  docker_host:
    description:
      - The daemon to use (the docker CLI's C(--host)); default the CLI's own (C(DOCKER_HOST), its context).
    type: str
  docker_timeout:
    description:
      - Seconds any one docker command the module runs (a save, load, pull or build) may take.
    type: float
    default: 3600.0
"""
