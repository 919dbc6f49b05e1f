"""The restore_run_context filter (plugins/filter/run_context.py) as Ansible calls it."""

from plugins.filter.run_context import restore_run_context


class HostBoundDict(dict):
    """Stands in for Ansible 2.19's lazy dict, whose deep copy drags every variable of the host along (0.3 s a host
    in the preparation stage's hand-on task): a deep copy of it fails the test."""

    def __deepcopy__(self, memo):
        raise AssertionError("the filter deep-copied a container Ansible handed it")


def test_the_filter_never_deep_copies_the_containers_ansible_hands_it():
    context = restore_run_context(
        HostBoundDict({"guest_os": "UBUNTU", "docker_env_vars": HostBoundDict({"A": "default"})}),
        HostBoundDict({"docker_env_vars": HostBoundDict({"B": "manifest"})}),
        HostBoundDict({"docker_env_vars": HostBoundDict({"C": "user"}), "mounts": [HostBoundDict({})]}),
        HostBoundDict({"gpu_vendor": "AMD"}),
    )
    assert context == {
        "guest_os": "UBUNTU",
        "docker_env_vars": {"A": "default", "B": "manifest", "C": "user"},
        "mounts": [{}],
        "gpu_vendor": "AMD",
    }
