"""The speed-up layer: every part of slurm-multi that makes Ansible cheaper to run, and nothing the pipeline needs.

Each part has the same result as plain Ansible, and the job runs the same without it (docs/speedup.md says what each
does; docs/figures.md what each saves). One setting, `speedup`, turns all of them off (switch.py), and they step
aside by themselves, with one warning, on an ansible-core whose private names they use changed (ansible_private.py,
the only file naming them).

    switch.py                    whether the layer works: the setting, then the private names; $SLURM_MULTI_SPEEDUP
    ansible_private.py           ansible-core's private names the layer uses, checked
    playbook.py                  slurm-multi-playbook: the routing file and the collection's bytecode kept
    preload.py                   the preload_plugins callback: plugins before the forks, payloads and templates kept
    server_step.py               the module_servers callback: one module server per node in push mode
    module_server.py             the module server: a node's modules as forks of a Python that imported Ansible once
    slurm-multi-module-python    the modules' interpreter (pip installs it beside the venv's python)
    slurm-multi-module-client    its client of the node's module server

plugins/callback/preload_plugins.py and module_servers.py are the files Ansible loads for the two callbacks.
"""
