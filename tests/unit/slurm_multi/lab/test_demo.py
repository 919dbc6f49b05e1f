"""`make demo`'s job: the runtime it asks for (RUNTIME=), and the refusal of one slurm-multi does not know."""

from slurm_multi.cli import main
from slurm_multi.lab.demo import demo_submit_args


def test_the_demo_asks_for_the_runtime_it_is_given():
    args = demo_submit_args("dummy_lastrank", "charliecloud")
    assert args[args.index("-e") + 1] == "container_runtime=charliecloud"


def test_an_unknown_runtime_is_refused_before_anything_is_queued_naming_the_runtimes(tmp_path, capsys):
    args = demo_submit_args("dummy_lastrank", "podman")
    args[args.index("--results-dir") + 1] = str(tmp_path / "results")
    assert main([arg for arg in args if arg != "--wait"] + ["--dry-run"]) == 2
    assert "docker, charliecloud" in capsys.readouterr().err
