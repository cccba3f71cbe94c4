"""A cluster's scheduler, read for a multi-machine launch (docs/sharding.md, "Several machines").

Under SLURM every node of a job sees the job's nodes and its own place among them in its environment:
`SLURM_JOB_NODELIST` (a compressed host list, `gpu-[01-04,07],login2`), `SLURM_NNODES` (or `SLURM_JOB_NUM_NODES`),
`SLURM_NODEID` (this node's index, 0 on the first host of the list) and the GPUs a node holds
(`SLURM_GPUS_ON_NODE`, or `SLURM_GPUS_PER_NODE` as `8` or `gpu:h100:8`). `slurm_launch` turns them into the
machine count, this machine's rank, the first host's address (the rendezvous) and the process count that
`accelerate launch` takes from its config file: `branchdiff accelerate-config multi-node` writes them into a copy
of the packaged config, one per node, so one `srun` line starts every node's launcher.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Launch:
    num_machines: int
    machine_rank: int
    main_process_ip: str
    main_process_port: int
    num_processes: int  # all machines' processes: machines × GPUs a node


def expand_hosts(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded in order: `gpu-[01-03,07],login2` → gpu-01, gpu-02, gpu-03, gpu-07, login2
    (zero padding kept); a name with several bracket groups expands to every combination, the last group fastest
    (`rack[1-2]-n[01-02]` → rack1-n01, rack1-n02, rack2-n01, rack2-n02), as SLURM's hostlist does."""
    return [host for item in _outside_brackets(nodelist, ",") for host in _expand_name(item)]


def _outside_brackets(text: str, separator: str) -> list[str]:
    """`text` split at each `separator` that is not inside brackets; empty parts dropped."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [part for part in [*parts, current] if part]


def _expand_name(name: str) -> list[str]:
    """One host name's bracket groups expanded, the first outermost."""
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", name)
    if not match:
        return [name]
    prefix, ranges, rest = match.groups()
    tails = _expand_name(rest)
    hosts: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"SLURM host list {name!r}: {part!r} is not a number or a range of numbers (e.g. 01-04)")
        for number in range(int(low), int(high or low) + 1):
            hosts.extend(f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails)
    return hosts


def _gpus_per_node(environ: Mapping[str, str]) -> int | None:
    """The GPUs a node holds: the first of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE that names a positive count (a step that
    asked for no GPUs sets SLURM_GPUS_ON_NODE=0 while the job's nodes hold SLURM_GPUS_PER_NODE)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "")
        match = re.search(r"(\d+)\s*$", value.split(",")[0]) if value else None  # "8", "gpu:8", "gpu:h100:8"
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def slurm_launch(environ: Mapping[str, str], gpus_here: int = 0) -> Launch | None:
    """The launch a SLURM job's environment describes (module doc), or None outside one. `gpus_here`: this machine's GPU
    count, where the job does not say how many GPUs a node holds. Raises ValueError, in one line, for an environment
    that names nodes but not this node's place among them."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_hosts(nodelist)
    count = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or len(hosts))
    rank = environ.get("SLURM_NODEID")
    if rank is None or not rank.isdigit() or int(rank) >= count or count != len(hosts):
        raise ValueError(f"a SLURM job's environment without this node's place: SLURM_NODEID={rank!r} for {count} nodes ({nodelist}); run "
                         "branchdiff accelerate-config multi-node inside the job's step on every node (srun ... bash -c '...'), not on the login node")
    per_node = _gpus_per_node(environ) or gpus_here
    if per_node < 1:
        raise ValueError("a SLURM job's environment names no GPUs a node (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE) and none is visible here; "
                         "ask for them (--gpus-per-node 8) or launch with accelerate launch --num_processes N")
    port = int(environ.get("MASTER_PORT") or DEFAULT_PORT)
    return Launch(count, int(rank), hosts[0], port, count * per_node)


def fill_config(text: str, launch: Launch) -> str:
    """The packaged multi-node config's YAML with the launch's values in place of its placeholders."""
    values = {"num_machines": launch.num_machines, "machine_rank": launch.machine_rank, "main_process_ip": launch.main_process_ip,
              "main_process_port": launch.main_process_port, "num_processes": launch.num_processes}
    for key, value in values.items():
        text, found = re.subn(rf"(?m)^{key}: .*$", f"{key}: {value}", text)
        if not found:
            raise ValueError(f"the multi-node config has no '{key}:' line to fill")
    return text
