"""Multi-process set-up (one process per host, or several per host for local tests) over jax.distributed.

Every process runs the same program: it initialises the distributed runtime before touching any device,
builds a mesh over all processes' devices, places the (identical) parameters, builds only its own rows of
the batch (``rows_for_process``), runs the same jitted decode, and reads the gathered tokens
(``sharding.sharded_decode.gather_output``).

Environment variables (set by ``sharding.launch`` for local runs; on a TPU pod slice none are needed,
``jax.distributed.initialize()`` finds the coordinator itself):
  JSPEC_COORDINATOR      host:port of process 0
  JSPEC_NUM_PROCESSES    number of processes
  JSPEC_PROCESS_ID       this process's index
  JSPEC_CPU_DEVICES      fake CPU devices per process (local CPU runs only)
"""

from __future__ import annotations

import os

import jax
import numpy as np

from sharding.placement import local_rows
from sharding.plan import DecodePlan

ENV_COORDINATOR = "JSPEC_COORDINATOR"
ENV_NUM_PROCESSES = "JSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JSPEC_PROCESS_ID"
ENV_CPU_DEVICES = "JSPEC_CPU_DEVICES"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices: int | None = None,
    auto: bool = False,
) -> bool:
    """Start jax.distributed from arguments or the JSPEC_* environment; call before any other JAX use.

    auto=True with nothing configured calls ``jax.distributed.initialize()`` bare (TPU pod slices, SLURM and
    other clusters JAX detects itself). Returns whether a multi-process runtime was started.
    """
    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR)
    num_processes = num_processes or (int(env[ENV_NUM_PROCESSES]) if ENV_NUM_PROCESSES in env else None)
    if process_id is None and ENV_PROCESS_ID in env:
        process_id = int(env[ENV_PROCESS_ID])
    cpu_devices = cpu_devices or (int(env[ENV_CPU_DEVICES]) if ENV_CPU_DEVICES in env else None)
    if cpu_devices:
        # Must precede backend initialisation; only affects the CPU platform.
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    if coordinator:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
        return True
    if auto:
        jax.distributed.initialize()
        return jax.process_count() > 1
    return False


def rows_for_process(plan: DecodePlan, global_batch: int) -> np.ndarray:
    """The batch rows this process must build (ascending). With the data axis leading in the mesh, each
    process gets a contiguous block; when the batch is not split (``tensor`` preset) every process builds
    every row. A batch the data axis does not divide is an error (pad it with dummy rows): the row sharding
    would fall back to replication and every process would build, and decode, every row."""
    if global_batch % plan.data_size:
        raise ValueError(
            f"batch {global_batch} is not divisible by the data axis ({plan.batch_axis}={plan.data_size}); "
            "pad the batch with dummy rows"
        )
    return local_rows(plan.rows((global_batch,), global_batch), (global_batch,))
