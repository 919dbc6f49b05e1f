"""The allocation as the inventory sees it: hostlists, ranks, rendezvous address and port, bad input."""

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import (
    AllocationError,
    allocation_from_env,
    default_master_port,
    expand_nodelist,
    routable_addresses,
)


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[001-004,010],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "login1"]),
        ("a[08-10]", ["a08", "a09", "a10"]),
        ("rack1-[2,4],rack2-[1-2]", ["rack1-2", "rack1-4", "rack2-1", "rack2-2"]),
        ("single", ["single"]),
        ("b[3,1]", ["b3", "b1"]),
    ],
)
def test_nodelist_expands_in_allocation_order(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "nodelist, message",
    [
        ("node[1-3", "not a valid hostlist"),
        ("node[3-1]", "not a valid hostlist"),
        ("", "is empty"),
        ("node[1-2],node2", "node2 more than once"),
    ],
)
def test_malformed_nodelist_is_refused_naming_the_variable(nodelist, message):
    with pytest.raises(AllocationError, match=message) as error:
        expand_nodelist(nodelist)
    assert "SLURM_JOB_NODELIST" in str(error.value)


def test_rank_zero_is_the_first_node_and_vars_describe_the_run():
    allocation = allocation_from_env(
        {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[002,001]", "SLURM_JOB_NUM_NODES": "2"}
    )
    assert allocation.nodes == ["gpu002", "gpu001"]
    assert allocation.ranks() == {"gpu002": 0, "gpu001": 1}
    assert allocation.job_vars() == {
        "nnodes": 2,
        "master_addr": "",
        "master_port": default_master_port("4242"),
        "slurm_job_id": "4242",
        "allocation_nodes": ["gpu002", "gpu001"],
        "node_addresses": {},
    }
    # The site config's addresses of the allocation's own nodes only.
    configured = allocation_from_env(
        {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[002,001]"}, {"gpu001": "10.0.0.1", "gpu009": "10.0.0.9"}
    )
    assert configured.job_vars()["node_addresses"] == {"gpu001": "10.0.0.1"}


def test_master_port_is_derived_from_the_job_id_so_two_jobs_differ():
    assert default_master_port("1001") != default_master_port("1002")
    assert default_master_port("1001") == default_master_port("1001")
    assert 1024 < default_master_port("999999") < 65536


def test_explicit_master_port_wins_and_a_bad_one_is_refused():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "MASTER_PORT": "31000"}
    assert allocation_from_env(env).master_port == 31000
    with pytest.raises(AllocationError, match="MASTER_PORT='99999'"):
        allocation_from_env(dict(env, MASTER_PORT="99999"))


def test_explicit_master_addr_ip_is_used_as_given():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]", "MASTER_ADDR": "127.0.0.11"}
    assert allocation_from_env(env).master_addr == "127.0.0.11"


def test_master_addr_name_is_left_for_rank_zero_to_resolve():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]", "MASTER_ADDR": "node1"}
    assert allocation_from_env(env).master_addr is None


def test_site_config_address_of_rank_zero_is_used():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[2-3]"}
    allocation = allocation_from_env(env, {"node2": "127.0.0.12", "node3": "127.0.0.13"})
    assert allocation.master_addr == "127.0.0.12"


def test_node_count_disagreeing_with_the_nodelist_is_refused():
    with pytest.raises(AllocationError, match="SLURM_JOB_NUM_NODES=4 disagrees"):
        allocation_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "4"})
    with pytest.raises(AllocationError, match="SLURM_NNODES='x' is not a node count"):
        allocation_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "x"})


def test_non_numeric_job_id_is_refused():
    with pytest.raises(AllocationError, match="SLURM_JOB_ID='abc'"):
        allocation_from_env({"SLURM_JOB_ID": "abc", "SLURM_JOB_NODELIST": "node1"})


def test_outside_an_allocation_it_is_a_one_node_run_on_localhost():
    allocation = allocation_from_env({})
    assert allocation.nodes == ["localhost"]
    assert allocation.job_vars()["nnodes"] == 1 and allocation.ranks() == {"localhost": 0}


def test_a_name_resolving_only_to_loopback_is_not_trusted():
    # 'localhost' resolves to 127.0.0.1 only: the Debian `127.0.1.1 hostname` trap has the same shape.
    assert routable_addresses("localhost") == []
    assert routable_addresses("no-such-host.invalid") == []
