"""The seam's promise (docs/runtimes.md, "Adding a runtime"): a runtime registered in RUNTIMES is asked by the stages
with no other edit - preflight runs its checks in place of the Docker ones it replaces, the build module takes its
builder, the run module runs what it picks - and no stage names it."""

from __future__ import annotations

import importlib.util
import json

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build import BuildOutcome
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.container_runtime import (
    ContainerRuntime,
    ImageBuilder,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes import RUNTIMES, by_name
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.runtimes.preflight import runtime_preflight
from tests.support.ansible import ROOT
from tests.support.lab.model_zoo import make_model_zoo

STAND_IN_ID = "sha256:" + "5e" * 32


class StandInBuilder(ImageBuilder):
    def __init__(self):
        self.plans = []

    def ensure(self, plan, force_rebuild, check_mode):
        self.plans.append(plan.image_name)
        return BuildOutcome(plan, "built", STAND_IN_ID, 0.0, "the stand-in built it")

    def manifest_fields(self, outcome):
        return {"container_runtime": "stand-in", "stand_in_image": f"/images/{outcome.plan.image_name}"}


class StandIn(ContainerRuntime):
    """A runtime no stage knows by name, with no Docker anywhere."""

    name = "stand-in"
    replaces_checks = ("docker", "disk", "stale_gpu_containers")
    asked = []
    built = StandInBuilder()

    def node_checks(self, node, settings, builds):
        self.asked.append((node, builds))
        problem = {"check": "stand-in", "problem": f"stand-in's tool missing on {node}", "fix": "install it"}
        return [problem], ["stand-in: checked"], {"stand_in_access": "in-place"}

    def builder(self, params, cards, zoo_root):
        return self.built


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(RUNTIMES, StandIn.name, StandIn)
    StandIn.asked.clear()
    StandIn.built = StandInBuilder()
    return StandIn


def test_preflight_runs_a_registered_runtimes_checks_in_place_of_dockers(stand_in):
    result = runtime_preflight(
        {"container_runtime": "stand-in", "node": "node9", "checks": ["docker", "disk", "stale_gpu_containers"],
         "builds": True}
    )  # fmt: skip
    assert stand_in.asked == [("node9", True)]
    assert result["problems"] == [
        {"check": "stand-in", "problem": "stand-in's tool missing on node9", "fix": "install it"}
    ]
    assert result["notes"] == ["stand-in: checked"]
    assert result["stand_in_access"] == "in-place"


def test_the_build_module_takes_a_registered_runtimes_builder(stand_in, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("build_images_seam", ROOT / "library" / "build_images.py")
    build_images = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_images)  # its container_runtime choices are RUNTIMES' names
    zoo = make_model_zoo(tmp_path / "zoo")
    manifest = tmp_path / "out" / "build_manifest.json"
    args = dict(
        models_file=str(zoo / "models.json"), tags=["dummy"], context={"gpu_vendor": "AMD", "guest_os": "UBUNTU"},
        manifest_path=str(manifest), container_runtime="stand-in",
    )  # fmt: skip
    with patch_module_args(args), pytest.raises(SystemExit):
        build_images.main()
    result = json.loads(capsys.readouterr().out)
    assert not result.get("failed"), result
    assert stand_in.built.plans == [result["image_name"]]
    assert result["image_id"] == STAND_IN_ID
    entry = json.loads(manifest.read_text())["built_images"][result["image_name"]]
    assert entry["container_runtime"] == "stand-in"
    assert entry["stand_in_image"] == f"/images/{result['image_name']}"


def test_each_runtime_picks_what_its_rank_runs_of_the_reference_and_the_id():
    assert by_name("docker").image_to_run("ci-dummy:latest", STAND_IN_ID) == STAND_IN_ID
    assert by_name("docker").image_to_run("ci-dummy:latest", "") == "ci-dummy:latest"
    assert by_name("charliecloud").image_to_run("/cache/ab.sqfs", STAND_IN_ID) == "/cache/ab.sqfs"
