"""The speed-up layer: every part of slurm-multi that makes Ansible cheaper to run, and nothing the pipeline needs.
One setting, `speedup`, turns it all off (switch.py); on an ansible-core whose private names it uses changed
(ansible_private.py, the only file naming them) it steps aside with one warning. Each part: docs/speedup.md."""
