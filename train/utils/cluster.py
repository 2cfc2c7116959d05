"""A scheduler's variables as launch_grpo.sh's rendezvous settings, in one place:

    eval "$(.venv/bin/python -m train.utils.cluster slurm)"   # in each srun task: NNODES, NODE_RANK, ...

SLURM (scripts/slurm/grpo.sbatch, one task per node): NNODES from SLURM_JOB_NUM_NODES, NODE_RANK from
SLURM_NODEID, MASTER_ADDR the first host of SLURM_JOB_NODELIST (`scontrol show hostnames`), MASTER_PORT
15000 + SLURM_JOB_ID % 10000 (one port per job, below Linux's ephemeral range; a requeued job keeps its id
and so its port), NPROC from SLURM_GPUS_ON_NODE. MASTER_PORT and NPROC already set are kept. A Kubeflow
PyTorchJob needs nothing here: launch_grpo.sh reads the operator's PET_* variables itself.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence


class ClusterError(ValueError):
    """The scheduler's environment lacks what the rendezvous needs."""


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`: a compressed list such as gpu[017-018] as host names."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except FileNotFoundError:
        raise ClusterError("scontrol is not on PATH: run this inside a SLURM job (sbatch / srun)") from None
    except subprocess.CalledProcessError as e:
        raise ClusterError(f"scontrol show hostnames {nodelist} failed ({e.returncode}): {e.stderr.strip()}") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"scontrol show hostnames {nodelist} did not answer within 60 s") from None
    return out.split()


def slurm_launch_env(environ: Mapping[str, str],
                     hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> dict[str, str]:
    """launch_grpo.sh's NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and NPROC for this srun task."""

    def need(name: str, number: bool = True) -> str:
        value = environ.get(name, "").strip()
        if not value:
            raise ClusterError(f"{name} is not set: run this in an srun task of a SLURM job "
                               "(scripts/slurm/grpo.sbatch runs it once per node)")
        if number and not value.isdigit():
            raise ClusterError(f"{name}={value!r} is not a whole number")
        return value

    job = need("SLURM_JOB_ID", number=False).split("_")[0]  # an array job's task: 1234_7
    nodelist, nnodes, node_rank = need("SLURM_JOB_NODELIST", number=False), need("SLURM_JOB_NUM_NODES"), need("SLURM_NODEID")
    hosts = hostnames(nodelist)
    if len(hosts) != int(nnodes):
        raise ClusterError(f"SLURM_JOB_NODELIST={nodelist} names {len(hosts)} host(s) but SLURM_JOB_NUM_NODES={nnodes}")
    if int(node_rank) >= int(nnodes):
        raise ClusterError(f"SLURM_NODEID={node_rank} is not below SLURM_JOB_NUM_NODES={nnodes}")
    nproc = environ.get("NPROC") or environ.get("SLURM_GPUS_ON_NODE")
    if not nproc:
        raise ClusterError("no processes per node: request GPUs (#SBATCH --gpus-per-node=8 sets SLURM_GPUS_ON_NODE) "
                           "or set NPROC (e.g. NPROC=8)")
    if not job.isdigit():
        raise ClusterError(f"SLURM_JOB_ID={job!r} is not a job number")
    port = environ.get("MASTER_PORT") or str(15000 + int(job) % 10000)
    return {"NNODES": nnodes, "NODE_RANK": node_rank, "MASTER_ADDR": hosts[0], "MASTER_PORT": port, "NPROC": nproc}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.utils.cluster",
                                     description="Print `export ...` of launch_grpo.sh's rendezvous variables "
                                                 "for this scheduler task, for `eval`.")
    parser.add_argument("scheduler", choices=["slurm"])
    parser.parse_args(argv)
    try:
        env = slurm_launch_env(os.environ)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
