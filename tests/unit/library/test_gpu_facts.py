"""GPU facts: the parsers on real recorded tool outputs (tests/fixtures/gpu-tools, see its README), detect_gpus
with fake tools that print those recordings, and the gpu_facts module run by Ansible on localhost."""

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.amd_tools import (
    parse_amd_smi_list_json,
    parse_amd_smi_static_json,
    parse_rocm_smi_json,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.facts import detect_gpus
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.kfd_topology import (
    attach_render_nodes,
    parse_kfd_node_properties,
    read_kfd_gpu_nodes,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.nvidia_tools import (
    nvidia_gpus_from_rows,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_list,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.gpu.records import (
    GpuToolOutputError,
    extract_json_document,
)

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "gpu-tools"
ANSIBLE = Path(sys.executable).with_name("ansible")

ALL_PARSERS = [
    parse_amd_smi_list_json,
    parse_amd_smi_static_json,
    parse_rocm_smi_json,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_list,
]


def recorded(name):
    return (FIXTURES / name).read_text(encoding="utf-8")


# --- amd-smi ---------------------------------------------------------------------------------------------------


def test_amd_smi_list_json_gives_index_uuid_and_pci_address():
    assert parse_amd_smi_list_json(recorded("amd-smi-list-json-1.txt")) == [
        {
            "index": 0,
            "name": None,
            "uuid": "00ff1586-0000-1000-8000-000000000000",
            "pci_bus": "0000:c4:00.0",
            "arch": None,
            "render_node": None,
            "mig_devices": [],
        }
    ]


def test_amd_smi_list_json_of_a_virtualization_host_ignores_the_virtual_functions():
    gpus = parse_amd_smi_list_json(recorded("amd-smi-list-json-2.txt"))
    assert [(gpu["index"], gpu["uuid"], gpu["pci_bus"]) for gpu in gpus] == [
        (0, "67ff74a1-0000-1000-8081-b5b9fd6edd00", "0000:0c:00.0")
    ]


def test_amd_smi_static_json_gives_market_name_and_gfx_target():
    assert parse_amd_smi_static_json(recorded("amd-smi-static-json-1.txt")) == {
        0: {
            "name": "Strix Halo [Radeon Graphics / Radeon 8050S Graphics / Radeon 8060S Graphics]",
            "arch": "gfx1151",
            "pci_bus": "0000:c4:00.0",
        }
    }


def test_amd_smi_static_json_in_the_gpu_data_wrapper_of_amd_smi_26():
    assert parse_amd_smi_static_json(recorded("amd-smi-static-json-2.txt")) == {
        0: {"name": "AMD Instinct MI210", "arch": "gfx90a", "pci_bus": None}
    }


def test_amd_smi_static_asic_only_output_is_enough_for_names():
    assert parse_amd_smi_static_json(recorded("amd-smi-static-asic-json-1.txt")) == {
        0: {"name": "Granite Ridge [Radeon Graphics]", "arch": "gfx1036", "pci_bus": None}
    }


def test_python_warnings_before_truncated_amd_smi_json_give_a_truncation_error():
    with pytest.raises(GpuToolOutputError) as error:
        parse_amd_smi_static_json(recorded("amd-smi-static-json-banner-truncated-1.txt"))
    assert error.value.tool == "amd-smi static --json"
    assert "truncated" in str(error.value) and "line 25" in str(error.value)


def test_watch_banner_before_truncated_amd_smi_json_gives_a_truncation_error():
    with pytest.raises(GpuToolOutputError, match=r"amd-smi list --json: .*incomplete or malformed \(truncated\?\)"):
        parse_amd_smi_list_json(recorded("amd-smi-metric-watch-json-banner-truncated-2.txt"))


@pytest.mark.parametrize(
    "name, said",
    [
        ("amd-smi-metric-watch-json-banner-1.txt", "'CTRL' + 'C' to stop watching output"),
        ("amd-smi-plain-nodriver-1.txt", "driver not initialized (amdgpu not found in modules)"),
        ("amd-smi-plain-groups-error-1.txt", "missing the following required groups: render, video"),
        ("amd-smi-plain-permission-banner-truncated-1.txt", "Permission needed to access required GPU device node"),
        ("amd-smi-static-error-1.txt", "Can not find a device"),
        ("amd-smi-monitor-groupwarning-1.txt", "User is missing the following required groups"),
        ("amd-smi-list-plain-1.txt", "AMDSMI Tool: 24.5.1+c5106a9"),
        ("amd-smi-list-csv-1.txt", "gpu,gpu_bdf,gpu_uuid"),
        ("amd-smi-plain-default-1.txt", "AMD-SMI            27.0.0"),
    ],
)
def test_amd_smi_output_without_json_is_an_error_quoting_what_the_tool_said(name, said):
    with pytest.raises(GpuToolOutputError) as error:
        parse_amd_smi_list_json(recorded(name))
    assert "no JSON in the output" in str(error.value)
    assert said in str(error.value)


def test_amd_smi_json_that_is_not_a_gpu_list_is_an_error_naming_the_keys_seen():
    with pytest.raises(GpuToolOutputError, match=r"no entry has a 'gpu' index \(keys seen: nic, uuid\)"):
        parse_amd_smi_list_json('[{"nic": 0, "uuid": "x"}]')


# --- rocm-smi --------------------------------------------------------------------------------------------------


def test_rocm_smi_json_of_four_mi100_gives_names_unique_ids_and_lowercase_pci_addresses():
    gpus = parse_rocm_smi_json(recorded("rocm-smi-json-1.txt"))
    assert [gpu["index"] for gpu in gpus] == [0, 1, 2, 3]
    assert {gpu["name"] for gpu in gpus} == {"Arcturus GL-XL [Instinct MI100]"}
    assert [gpu["pci_bus"] for gpu in gpus] == ["0000:83:00.0", "0000:a3:00.0", "0000:c3:00.0", "0000:e3:00.0"]
    assert gpus[0]["uuid"] == "0x79ccd55167a2124a"


def test_rocm_smi_json_with_a_leading_blank_line_and_na_unique_ids():
    gpus = parse_rocm_smi_json(recorded("rocm-smi-json-2.txt"))
    assert len(gpus) == 6
    assert {gpu["uuid"] for gpu in gpus} == {None}
    assert gpus[5]["pci_bus"] == "0000:49:00.0"


def test_rocm_smi_6_1_json_prefers_device_name_and_reports_the_gfx_version():
    [gpu] = parse_rocm_smi_json(recorded("rocm-smi-json-3.txt"))
    assert gpu["name"] == "Navi 22 [Radeon RX 6700/6700 XT / 6800M]"
    assert gpu["arch"] == "gfx1031"
    assert gpu["pci_bus"] == "0000:07:00.0"


def test_rocm_smi_one_line_json_of_an_mi250():
    [gpu] = parse_rocm_smi_json(recorded("rocm-smi-all-json-1.txt"))
    assert (gpu["name"], gpu["uuid"], gpu["pci_bus"]) == (
        "AMD INSTINCT MI250 (MCM) OAM AC MBA",
        "0x719d230578348e8c",
        "0000:2f:00.0",
    )


@pytest.mark.parametrize(
    "name, expected",
    [
        ("rocm-smi-showproductname-json-1.txt", ("Radeon RX 7900 XT", "gfx1100")),
        ("rocm-smi-showproductname-json-2.txt", ("AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2", "gfx9010")),
    ],
)
def test_rocm_smi_productname_json_gives_card_series_and_gfx_version(name, expected):
    [gpu] = parse_rocm_smi_json(recorded(name))
    assert (gpu["name"], gpu["arch"]) == expected


def test_rocm_smi_banner_before_json_without_cards_means_no_gpus():
    assert parse_rocm_smi_json(recorded("rocm-smi-all-json-nogpu-1.txt")) == []


@pytest.mark.parametrize(
    "name",
    [
        "rocm-smi-showrasinfo-json-nodata-1.txt",
        "rocm-smi-plain-nodriver-1.txt",
        "rocm-smi-plain-nogpu-1.txt",
        "rocm-smi-plain-1.txt",
        "rocm-smi-plain-lowpower-truncated-1.txt",
        "rocm-smi-showid-1.txt",
        "rocm-smi-showproductname-csv-1.txt",
        "rocm-smi-showallinfo-1.txt",
        "rocm-smi-showuniqueid-1.txt",
    ],
)
def test_rocm_smi_output_without_json_is_an_error_naming_rocm_smi(name):
    with pytest.raises(GpuToolOutputError, match=r"^rocm-smi --json: no JSON in the output"):
        parse_rocm_smi_json(recorded(name))


# --- nvidia-smi ------------------------------------------------------------------------------------------------


def test_nvidia_smi_csv_of_212_fields_keys_rows_by_field_name_without_units():
    [row] = parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-1.txt"))
    assert len(row) == 212
    assert row["name"] == "NVIDIA H200"
    assert row["pci.bus_id"] == "00000000:83:00.0"
    assert row["memory.total"] == "143771 MiB"


def test_nvidia_smi_csv_turns_bracketed_na_into_none():
    [row] = parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-3.txt"))
    assert row["serial"] is None and row["mig.mode.current"] is None
    assert row["driver_model.current"] == "WDDM"


def test_nvidia_smi_csv_skips_blank_lines_and_unknown_errors():
    [row] = parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-6.txt"))
    assert row["name"] == "GeForce RTX 2080 Ti"
    assert row["power.draw"] == "228.82"
    assert row["power.default_limit"] is None


def test_nvidia_gpus_from_a_five_gpu_query_in_index_order():
    gpus = nvidia_gpus_from_rows(parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-4.txt")))
    assert [(gpu["index"], gpu["name"]) for gpu in gpus] == [
        (0, "GeForce GTX 1060 6GB"),
        (1, "GeForce GTX 1080 Ti"),
        (2, "GeForce GTX 1060 6GB"),
        (3, "GeForce GTX 1060 6GB"),
        (4, "GeForce GTX 1060 6GB"),
    ]
    assert gpus[4]["uuid"] == "GPU-ff3318a7-f0dd-dc57-1fb8-cc95ba35c56e"


def test_nvidia_gpus_get_a_four_digit_pci_domain():
    [gpu] = nvidia_gpus_from_rows(parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-2.txt")))
    assert (gpu["name"], gpu["pci_bus"]) == ("NVIDIA H100 80GB HBM3", "0000:00:09.0")


def test_nvidia_query_without_an_index_field_is_an_error_listing_the_fields():
    with pytest.raises(GpuToolOutputError, match=r"no 'index' field \(fields: name\)"):
        nvidia_gpus_from_rows(parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-csv-5.txt")))


def test_nvidia_smi_invalid_field_message_is_not_taken_for_a_header():
    with pytest.raises(GpuToolOutputError, match='not a CSV header.*Field "device_minor" is not a valid field'):
        parse_nvidia_smi_csv(recorded("nvidia-smi-query-gpu-invalid-field-1.txt"))


def test_a_cut_off_nvidia_smi_csv_row_is_an_error():
    text = recorded("nvidia-smi-query-gpu-csv-4.txt")
    with pytest.raises(GpuToolOutputError, match=r"line 6 has 3 fields but the header has 4 \(truncated output\?\)"):
        parse_nvidia_smi_csv(text[: text.rindex(",")])


def test_nvidia_smi_list_of_mixed_mig_and_plain_a100s():
    gpus = parse_nvidia_smi_list(recorded("nvidia-smi-L-4.txt"))
    assert [(gpu["index"], gpu["name"], len(gpu["mig_devices"])) for gpu in gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", 4),
        (1, "NVIDIA A100-SXM4-80GB", 0),
        (2, "NVIDIA A100-SXM4-80GB", 0),
        (3, "NVIDIA A100-SXM4-80GB", 0),
    ]
    assert gpus[0]["mig_devices"][3] == {
        "index": 3,
        "profile": "1g.20gb",
        "uuid": "MIG-930574a9-d43a-5d2b-95da-3e68384c8d6b",
    }
    assert gpus[3]["uuid"] == "GPU-69ec2344-ebac-b028-f88f-452abb3d7f11"


def test_nvidia_smi_list_reads_media_extension_mig_profiles():
    [gpu] = parse_nvidia_smi_list(recorded("nvidia-smi-L-2.txt"))
    assert [mig["profile"] for mig in gpu["mig_devices"]] == [
        "1c.3g.71gb",
        "2c.3g.71gb",
        "2g.35gb",
        "1g.18gb",
        "1g.18gb",
    ]


@pytest.mark.parametrize(
    "name, count, first_name",
    [
        ("nvidia-smi-L-3.txt", 1, "NVIDIA GeForce RTX 2080 SUPER"),
        ("nvidia-smi-L-5.txt", 2, "Quadro RTX 4000"),
        ("nvidia-smi-L-6.txt", 4, "NVIDIA GeForce RTX 3090"),
        ("nvidia-smi-nvlink-unsupported-2.txt", 1, "NVIDIA L40S"),
    ],
)
def test_nvidia_smi_list_counts_and_names(name, count, first_name):
    gpus = parse_nvidia_smi_list(recorded(name))
    assert len(gpus) == count and gpus[0]["name"] == first_name


@pytest.mark.parametrize(
    "name",
    [
        "nvidia-smi-plain-nodevices-1.txt",
        "nvidia-smi-plain-nodriver-1.txt",
        "nvidia-smi-plain-version-mismatch-1.txt",
        "nvidia-smi-topo-error-1.txt",
    ],
)
def test_nvidia_smi_error_messages_are_not_a_gpu_list(name):
    with pytest.raises(GpuToolOutputError, match=r"^nvidia-smi -L: no 'GPU <n>: <name> \(UUID: \.\.\.\)' line"):
        parse_nvidia_smi_list(recorded(name))


# --- JSON extraction and bad input -----------------------------------------------------------------------------


def test_a_json_block_emitted_twice_is_read_once():
    text = recorded("amd-smi-list-json-1.txt")
    assert parse_amd_smi_list_json(text + "\n" + text) == parse_amd_smi_list_json(text)


def test_warnings_after_the_json_are_ignored():
    text = recorded("amd-smi-list-json-2.txt") + "WARNING: something went wrong on another GPU\n"
    assert len(parse_amd_smi_list_json(text)) == 1


def test_a_banner_line_starting_with_a_bracket_is_skipped():
    text = "[WARN] amd-smi is deprecated, use amd-smi 2\n" + recorded("amd-smi-list-json-1.txt")
    assert extract_json_document(text, "amd-smi")[0]["gpu"] == 0


@pytest.mark.parametrize("parser", ALL_PARSERS)
@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "\x00\x01\x02binary",
        "<html><body>502 Bad Gateway</body></html>",
        "{not json at all",
    ],
)
def test_garbage_gives_a_gpu_tool_output_error_from_every_parser(parser, garbage):
    with pytest.raises(GpuToolOutputError):
        parser(garbage)


@pytest.mark.parametrize(
    "parser, document, problem",
    [
        (parse_amd_smi_list_json, '{"gpu_data": 5}', "expected a JSON array of GPUs"),
        (parse_amd_smi_list_json, "[1, 2]", "entry 0 is a int"),
        (parse_amd_smi_list_json, '[{"gpu": "zero"}]', "GPU index 'zero' is not a non-negative integer"),
        (parse_amd_smi_list_json, '[{"gpu": 0}, {"gpu": 0}]', "GPU index 0 is listed twice"),
        (parse_amd_smi_list_json, '[{"gpu": 0, "bdf": "c4:00"}]', "'c4:00' is not a PCI address"),
        (parse_rocm_smi_json, '["card0"]', "expected a JSON object of cards"),
        (parse_rocm_smi_json, '{"card0": "MI300X"}', "card0 is a str, not an object"),
    ],
)
def test_json_of_the_wrong_shape_gives_a_clear_error(parser, document, problem):
    with pytest.raises(GpuToolOutputError) as error:
        parser(document)
    assert problem in str(error.value)


# --- KFD topology ----------------------------------------------------------------------------------------------

CPU_NODE = "cpu_cores_count 96\nsimd_count 0\nmem_banks_count 1\nlocation_id 0\ndomain 0\ndrm_render_minor 0\n"


def gpu_node_properties(bus, render, domain=0):
    return (
        "cpu_cores_count 0\nsimd_count 480\nmem_banks_count 1\ngfx_target_version 90008\nvendor_id 4098\n"
        f"device_id 29580\nlocation_id {bus << 8}\ndomain {domain}\ndrm_render_minor {render}\n"
        "unique_id 8776245417467383370\nnum_xcc 1\n"
    )


def kfd_topology(directory, nodes):
    """A sysfs-like KFD topology: nodes/<n>/properties for each text in `nodes`."""
    for number, properties in enumerate(nodes):
        (directory / str(number)).mkdir(parents=True)
        (directory / str(number) / "properties").write_text(properties)
    return directory


def test_kfd_properties_are_read_as_integers():
    assert parse_kfd_node_properties("simd_count 480\nunique_id 8776245417467383370\n") == {
        "simd_count": 480,
        "unique_id": 8776245417467383370,
    }


def test_a_malformed_kfd_properties_line_is_an_error_naming_the_file():
    with pytest.raises(GpuToolOutputError, match=r"nodes/1/properties: line 2 is not '<key> <integer>'"):
        parse_kfd_node_properties("simd_count 480\nlocation_id none\n", "nodes/1/properties")


def test_kfd_gpu_nodes_skip_cpus_and_decode_the_pci_address(tmp_path):
    nodes = kfd_topology(tmp_path, [CPU_NODE, gpu_node_properties(0x83, 128), gpu_node_properties(0xA3, 136, 1)])
    assert read_kfd_gpu_nodes(str(nodes)) == [
        {"node": 1, "pci_bus": "0000:83:00.0", "render_node": 128},
        {"node": 2, "pci_bus": "0001:a3:00.0", "render_node": 136},
    ]


def test_render_nodes_are_matched_by_pci_address_not_position():
    gpus = parse_rocm_smi_json(recorded("rocm-smi-json-1.txt"))
    # The topology lists an extra iGPU first and the MI100s out of order: a positional zip would be wrong.
    kfd_nodes = [
        {"node": 1, "pci_bus": "0000:0a:00.0", "render_node": 128},
        {"node": 2, "pci_bus": "0000:e3:00.0", "render_node": 129},
        {"node": 3, "pci_bus": "0000:83:00.0", "render_node": 130},
        {"node": 4, "pci_bus": "0000:c3:00.0", "render_node": 131},
        {"node": 5, "pci_bus": "0000:a3:00.0", "render_node": 132},
    ]
    mapped, warnings = attach_render_nodes(gpus, kfd_nodes)
    assert [gpu["render_node"] for gpu in mapped] == [130, 132, 131, 129]
    assert warnings == []


def test_a_gpu_missing_from_the_kfd_topology_keeps_no_render_node_and_is_warned_about():
    gpus = parse_rocm_smi_json(recorded("rocm-smi-json-1.txt"))
    mapped, warnings = attach_render_nodes(gpus, [{"node": 1, "pci_bus": "0000:83:00.0", "render_node": 128}])
    assert [gpu["render_node"] for gpu in mapped] == [128, None, None, None]
    assert warnings[0] == "GPU 1 (0000:a3:00.0) is not in the KFD topology: render node unknown"


def test_two_kfd_nodes_at_one_address_leave_the_render_node_unknown():
    gpus = parse_amd_smi_list_json(recorded("amd-smi-list-json-1.txt"))
    mapped, warnings = attach_render_nodes(
        gpus,
        [
            {"node": 1, "pci_bus": "0000:c4:00.0", "render_node": 128},
            {"node": 2, "pci_bus": "0000:c4:00.0", "render_node": 129},
        ],
    )
    assert mapped[0]["render_node"] is None
    assert "matches KFD nodes 1, 2" in warnings[0]


def test_a_gpu_without_a_pci_address_gets_no_render_node():
    gpus = parse_rocm_smi_json(recorded("rocm-smi-showproductname-json-1.txt"))
    mapped, warnings = attach_render_nodes(gpus, [{"node": 1, "pci_bus": "0000:03:00.0", "render_node": 128}])
    assert mapped[0]["render_node"] is None
    assert warnings == ["GPU 0 has no PCI address, so its render node is unknown"]


# --- detect_gpus with fake tools -------------------------------------------------------------------------------

HANG = object()


def fake_tool(directory, name, answers):
    """An executable `name` in `directory` answering each exact argument string with a recorded fixture.

    answers: {"list --json": "fixture.txt" | ("fixture.txt", exit code) | HANG}; other arguments exit 2.
    HANG starts a child that sleeps, writes its pid to <directory>/<name>.child, and waits for it.
    """
    lines = ["#!/bin/sh", 'case "$*" in']
    for args, answer in answers.items():
        if answer is HANG:
            child_pid = shlex.quote(str(directory / f"{name}.child"))
            action = f"sleep 60 & echo $! > {child_pid}; wait"
        else:
            fixture, code = answer if isinstance(answer, tuple) else (answer, 0)
            action = f"cat {shlex.quote(str(FIXTURES / fixture))}; exit {code}"
        lines.append(f"  {shlex.quote(args)}) {action};;")
    lines += ['  *) echo "unexpected arguments: $*" >&2; exit 2;;', "esac", ""]
    path = directory / name
    path.write_text("\n".join(lines))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


NVIDIA_QUERY = "--query-gpu=index,name,uuid,pci.bus_id --format=csv"
AMD_ROCM_SMI_QUERY = "--showproductname --showbus --showuniqueid --json"


@pytest.fixture
def tools(tmp_path):
    directory = tmp_path / "bin"
    directory.mkdir()
    return directory


def test_amd_smi_gpu_gets_name_arch_and_render_node_from_kfd(tools, tmp_path):
    fake_tool(
        tools,
        "amd-smi",
        {"list --json": "amd-smi-list-json-1.txt", "static --asic --json": "amd-smi-static-json-1.txt"},
    )
    topology = kfd_topology(tmp_path / "nodes", [CPU_NODE, gpu_node_properties(0xC4, 128)])
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(topology), timeout=10)
    assert facts == {
        "vendor": "AMD",
        "warnings": [],
        "gpus": [
            {
                "index": 0,
                "name": "Strix Halo [Radeon Graphics / Radeon 8050S Graphics / Radeon 8060S Graphics]",
                "uuid": "00ff1586-0000-1000-8000-000000000000",
                "pci_bus": "0000:c4:00.0",
                "arch": "gfx1151",
                "render_node": 128,
                "mig_devices": [],
            }
        ],
    }


def test_a_failing_amd_smi_static_only_costs_the_names(tools, tmp_path):
    fake_tool(
        tools,
        "amd-smi",
        {"list --json": "amd-smi-list-json-1.txt", "static --asic --json": ("amd-smi-static-error-1.txt", 1)},
    )
    topology = kfd_topology(tmp_path / "nodes", [CPU_NODE, gpu_node_properties(0xC4, 128)])
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(topology), timeout=10)
    assert facts["vendor"] == "AMD" and facts["gpus"][0]["name"] is None
    assert facts["warnings"] == [
        "amd-smi static --asic --json failed (exit code 1): Can not find a device: GPU '123123' Error code: -3"
    ]


def test_rocm_smi_is_used_when_amd_smi_is_absent(tools, tmp_path):
    fake_tool(tools, "rocm-smi", {AMD_ROCM_SMI_QUERY: "rocm-smi-json-1.txt"})
    topology = kfd_topology(
        tmp_path / "nodes",
        [CPU_NODE] + [gpu_node_properties(bus, 128 + number) for number, bus in enumerate((0x83, 0xA3, 0xC3, 0xE3))],
    )
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(topology), timeout=10)
    assert facts["vendor"] == "AMD"
    assert [(gpu["index"], gpu["render_node"]) for gpu in facts["gpus"]] == [(0, 128), (1, 129), (2, 130), (3, 131)]


def test_amd_smi_without_a_driver_falls_back_to_rocm_smi_and_says_why(tools, tmp_path):
    fake_tool(tools, "amd-smi", {"list --json": "amd-smi-plain-nodriver-1.txt"})
    fake_tool(tools, "rocm-smi", {AMD_ROCM_SMI_QUERY: ("rocm-smi-plain-nodriver-1.txt", 1)})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts["vendor"] == "none" and facts["gpus"] == []
    assert facts["warnings"][0].startswith(
        "cannot read the output of amd-smi list --json: no JSON in the output: "
        "ERROR:root:Unable to get devices, driver not initialized"
    )
    assert facts["warnings"][1].startswith(
        "rocm-smi --showproductname --showbus --showuniqueid --json failed "
        "(exit code 1): cat: /sys/module/amdgpu/initstate"
    )


def test_rocm_smi_with_no_cards_is_reported_as_no_gpus(tools, tmp_path):
    fake_tool(tools, "rocm-smi", {AMD_ROCM_SMI_QUERY: "rocm-smi-all-json-nogpu-1.txt"})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts == {"vendor": "none", "gpus": [], "warnings": ["rocm-smi lists no GPUs"]}


def test_an_unreadable_kfd_topology_means_no_usable_gpus_with_rocminfo_saying_why(tools, tmp_path):
    fake_tool(
        tools,
        "amd-smi",
        {"list --json": "amd-smi-list-json-1.txt", "static --asic --json": "amd-smi-static-json-1.txt"},
    )
    fake_tool(tools, "rocminfo", {"": ("rocminfo-nodriver-1.txt", 1)})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts["vendor"] == "none" and facts["gpus"] == []
    [warning] = facts["warnings"]
    assert "list 1 AMD GPU(s) but the KFD topology" in warning and "unreadable" in warning
    assert warning.endswith("rocminfo says: ROCk module is NOT loaded, possibly no GPU devices")


def test_rocminfo_kfd_access_errors_are_quoted(tools, tmp_path):
    fake_tool(
        tools,
        "amd-smi",
        {"list --json": "amd-smi-list-json-1.txt", "static --asic --json": "amd-smi-static-json-1.txt"},
    )
    fake_tool(tools, "rocminfo", {"": ("rocminfo-kfd-error-1.txt", 1)})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert "Unable to open /dev/kfd read-write: Invalid argument" in facts["warnings"][0]


def test_nvidia_gpus_with_mig_instances_from_the_same_host(tools, tmp_path):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: "nvidia-smi-query-gpu-csv-2.txt", "-L": "nvidia-smi-L-1.txt"})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts["vendor"] == "NVIDIA"
    [gpu] = facts["gpus"]
    assert (gpu["index"], gpu["name"], gpu["pci_bus"]) == (0, "NVIDIA H100 80GB HBM3", "0000:00:09.0")
    assert [mig["profile"] for mig in gpu["mig_devices"]] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert facts["warnings"] == [
        "GPU 0 is in MIG mode with 4 instance(s): a container given this GPU gets all of them "
        "(SLURM MIG allocations are not mapped to single instances)"
    ]


def test_a_failing_nvidia_smi_list_only_costs_the_mig_details(tools, tmp_path):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: "nvidia-smi-query-gpu-csv-4.txt"})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts["vendor"] == "NVIDIA" and len(facts["gpus"]) == 5
    assert facts["warnings"] == ["nvidia-smi -L failed (exit code 2): unexpected arguments: -L"]


@pytest.mark.parametrize(
    "fixture, code, said",
    [
        ("nvidia-smi-plain-nodevices-1.txt", 6, "No devices were found"),
        ("nvidia-smi-plain-nodriver-1.txt", 9, "couldn't communicate with the NVIDIA driver"),
        ("nvidia-smi-plain-version-mismatch-1.txt", 18, "Driver/library version mismatch | NVML library version"),
    ],
)
def test_a_failing_nvidia_smi_means_no_gpus_with_its_message(tools, tmp_path, fixture, code, said):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: (fixture, code)})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts["vendor"] == "none"
    [warning] = facts["warnings"]
    assert warning.startswith(f"nvidia-smi {NVIDIA_QUERY} failed (exit code {code}): ") and said in warning


def process_is_gone(pid, within=5.0):
    """True once `pid` no longer runs (it may linger as a zombie until its new parent reaps it). A SIGKILL is
    delivered at once but acted on when the process next runs: on a busy machine a moment later (a CI run saw the
    child still there right after detect_gpus returned)."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_a_hanging_tool_is_stopped_with_its_children_and_reported(tools, tmp_path):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: HANG})
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=0.5)
    assert facts["vendor"] == "none"
    assert facts["warnings"] == [f"nvidia-smi {NVIDIA_QUERY} did not answer within 0.5 s and was stopped"]
    assert process_is_gone(int((tools / "nvidia-smi.child").read_text()))


def test_no_gpu_tool_on_path_means_none_and_says_so(tools, tmp_path):
    facts = detect_gpus(search_path=str(tools), kfd_topology_dir=str(tmp_path / "absent"), timeout=10)
    assert facts == {
        "vendor": "none",
        "gpus": [],
        "warnings": ["none of amd-smi, rocm-smi, nvidia-smi is on PATH, so no GPU was detected"],
    }


def test_amd_gpus_win_over_nvidia_on_a_node_with_both_tools(tools, tmp_path):
    fake_tool(
        tools,
        "amd-smi",
        {"list --json": "amd-smi-list-json-1.txt", "static --asic --json": "amd-smi-static-json-1.txt"},
    )
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: "nvidia-smi-query-gpu-csv-4.txt", "-L": "nvidia-smi-L-6.txt"})
    topology = kfd_topology(tmp_path / "nodes", [gpu_node_properties(0xC4, 128)])
    assert detect_gpus(search_path=str(tools), kfd_topology_dir=str(topology), timeout=10)["vendor"] == "AMD"


# --- the module, run by Ansible --------------------------------------------------------------------------------


@pytest.fixture
def run_gpu_facts(tmp_path, tools):
    """run(env_overrides, *ansible_options) -> (exit code, task result, stderr) of `ansible localhost -m gpu_facts`.

    The fake tools directory comes first on PATH; fake amd-smi and rocm-smi without a driver shadow any real ones.
    """
    fake_tool(tools, "amd-smi", {"list --json": "amd-smi-plain-nodriver-1.txt"})
    fake_tool(tools, "rocm-smi", {AMD_ROCM_SMI_QUERY: ("rocm-smi-plain-nodriver-1.txt", 1)})
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        json.dumps(
            {
                "all": {
                    "hosts": {
                        "localhost": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                        }
                    }
                }
            }
        )
    )

    def run(env_overrides, *options):
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        env.update(
            ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
            ANSIBLE_INVENTORY_ENABLED="yaml",  # this file only; the SLURM plugin would claim it first
            ANSIBLE_CALLBACK_RESULT_FORMAT="json",
            PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
            **env_overrides,
        )
        completed = subprocess.run(
            [str(ANSIBLE), "localhost", "-i", str(inventory), "-m", "gpu_facts", "-a", "timeout=10", *options],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # The default callback prints `localhost | SUCCESS => {...}` (or `FAILED! =>`), the result as JSON.
        _, separator, result_text = completed.stdout.partition(" => ")
        assert separator, completed.stdout + completed.stderr
        return completed.returncode, json.loads(result_text), completed.stderr

    return run


def test_module_reports_the_nodes_gpus_and_the_allocation_in_check_mode(run_gpu_facts, tools):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: "nvidia-smi-query-gpu-csv-4.txt", "-L": "nvidia-smi-L-6.txt"})
    code, result, stderr = run_gpu_facts({"SLURM_JOB_GPUS": "0,2-3"}, "--check")
    assert code == 0, result
    assert result["changed"] is False
    assert result["gpu_vendor"] == "NVIDIA"
    assert [gpu["name"] for gpu in result["gpus"]][:2] == ["GeForce GTX 1060 6GB", "GeForce GTX 1080 Ti"]
    assert result["allocated_gpus"] == [0, 2, 3]
    assert "driver not initialized" in stderr  # the fake amd-smi's complaint is shown as a warning


def test_module_fails_when_slurm_allocated_a_gpu_the_node_lacks(run_gpu_facts, tools):
    fake_tool(tools, "nvidia-smi", {NVIDIA_QUERY: "nvidia-smi-query-gpu-csv-4.txt", "-L": "nvidia-smi-L-6.txt"})
    code, result, _ = run_gpu_facts({"SLURM_STEP_GPUS": "7", "SLURM_JOB_GPUS": "0"})
    assert code != 0
    assert result["msg"].startswith("SLURM allocated GPU(s) 7, which this node does not have (its GPUs: 0, 1, 2, 3, 4)")


def test_module_without_gpus_succeeds_with_vendor_none(run_gpu_facts):
    code, result, stderr = run_gpu_facts({})
    assert code == 0, result
    assert (result["gpu_vendor"], result["gpus"], result["allocated_gpus"]) == ("none", [], None)
    assert "[WARNING]: cannot read the output of amd-smi list --json" in stderr
