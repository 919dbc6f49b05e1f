"""What the attributes every custom module declares mean; each module says how far it supports them."""


class ModuleDocFragment:
    """`extends_documentation_fragment: module_attributes` in a module's DOCUMENTATION, beside its `attributes:`."""

    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Runs with C(--check), deciding what it would do and reporting it (C(changed) included) without
      doing it.
  diff_mode:
    description: With C(--diff), returns what changed (or would change in check mode) as a diff.
"""
