"""A SLURM job's environment read for a multi-machine launch (branchdiff/runtime/cluster.py): SLURM's compressed host
lists, the machine count, this node's rank, the rendezvous and the process count, and `branchdiff accelerate-config
multi-node` writing them into a copy of the packaged config (with the variables set as SLURM sets them)."""

from __future__ import annotations

import pytest
import yaml

from branchdiff.cli import main
from branchdiff.runtime.cluster import Launch, expand_hosts, slurm_launch


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("gpu-01", ["gpu-01"]),
    ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
    ("gpu-[8-10],login2", ["gpu-8", "gpu-9", "gpu-10", "login2"]),
    ("a[001-002]x,b[1]", ["a001x", "a002x", "b1"]),
    # two bracket groups in a name (refused as "without this node's place"): every combination, the last group fastest
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("r[1]-n[01,03],login", ["r1-n01", "r1-n03", "login"]),
])
def test_slurms_host_lists_expand_in_order(nodelist, hosts):
    assert expand_hosts(nodelist) == hosts


def test_a_jobs_environment_gives_the_launch():
    job = {"SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_PER_NODE": "gpu:h100:8"}
    assert slurm_launch(job) == Launch(2, 1, "gpu-01", 29500, 16)
    assert slurm_launch({**job, "SLURM_GPUS_PER_NODE": "", "MASTER_PORT": "29611"}, gpus_here=4) == Launch(2, 1, "gpu-01", 29611, 8)
    assert slurm_launch({}) is None
    with pytest.raises(ValueError, match=r"SLURM_NODEID=None for 2 nodes \(gpu-\[01-02\]\); run branchdiff accelerate-config multi-node inside"):
        slurm_launch({k: v for k, v in job.items() if k != "SLURM_NODEID"})
    with pytest.raises(ValueError, match=r"names no GPUs a node"):
        slurm_launch({**job, "SLURM_GPUS_PER_NODE": ""})
    # a step that asked for no GPUs sets SLURM_GPUS_ON_NODE=0: it overrode the nodes' 8 and stopped the launch
    assert slurm_launch({**job, "SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_NODE": "8"}) == Launch(2, 1, "gpu-01", 29500, 16)
    four = {"SLURM_JOB_NODELIST": "rack[1-2]-n[01-02]", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_GPUS_PER_NODE": "8"}
    assert slurm_launch(four) == Launch(4, 3, "rack1-n01", 29500, 32)
    with pytest.raises(ValueError, match=r"SLURM host list 'gpu-\[a-b\]': 'a-b' is not a number or a range of numbers"):
        expand_hosts("gpu-[a-b]")


def test_accelerate_config_multi_node_fills_the_jobs_values(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    for key, value in {"SLURM_JOB_NODELIST": "node[3-4]", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2",
                       "SLURM_JOB_ID": "4242"}.items():
        monkeypatch.setenv(key, value)
    assert main(["accelerate-config", "multi-node"]) == 0
    captured = capsys.readouterr()
    path = captured.out.strip()
    assert path == str(tmp_path / "branchdiff-multi-node-4242-0.yaml")
    config = yaml.safe_load(open(path).read())
    assert (config["num_machines"], config["machine_rank"], config["main_process_ip"], config["num_processes"]) == (2, 0, "node3", 4)
    assert "this machine's rank 0, rendezvous at node3:29500" in captured.err
    monkeypatch.setenv("SLURM_NODEID", "5")
    assert main(["accelerate-config", "multi-node"]) == 2
    assert "SLURM_NODEID='5' for 2 nodes" in capsys.readouterr().err


def test_plan_counts_the_gradient_all_reduce_between_machines(capsys):
    """2·(M − 1)/M of the fp32 gradients out of every machine per all-reduce, one all-reduce per optimizer step."""
    from branchdiff.plan.estimate import internode_traffic

    assert internode_traffic(100.0, 4, 3) == {"nodes": 4, "gradient_bytes": 100.0, "all_reduces": 3, "bytes_per_machine": 2 * 3 / 4 * 100 * 3}
    assert internode_traffic(100.0, 1, 3)["bytes_per_machine"] == 0
    assert main(["plan", "sd35-pickscore", "--gpus", "16", "--nodes", "2", "--json", "-"]) in (0, 1)
    import json

    plan = json.loads(capsys.readouterr().out)
    lora = plan["parameters"]["trained"]
    assert plan["network"]["gradient_bytes"] == lora * 4 and plan["network"]["bytes_per_machine"] == lora * 4 * plan["network"]["all_reduces"]
    assert main(["plan", "sd35-pickscore", "--gpus", "3", "--nodes", "2"]) == 2
    assert "--nodes 2 with --gpus 3: the processes are spread evenly" in capsys.readouterr().err
