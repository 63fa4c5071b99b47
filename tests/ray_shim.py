"""Test-only shim: let vLLM 0.32's Ray executor place its workers on a CPU-only machine.

Target: ``vllm.platforms.cpu.CpuPlatform.ray_device_key`` (``""``),
``vllm.v1.executor.ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs`` and
``RayWorkerProc.get_node_and_physical_gpu_ids``.

Why: on CPU vLLM refuses ``distributed_executor_backend="ray"`` ("current platform
cpu does not support ray"): its CPU platform names no Ray device resource. With
only the key set to Ray's ``"CPU"`` the executor still cannot start, for two
precise reasons found here:
  1. it creates each worker actor with ``.options(num_cpus=0, **kwargs)`` where
     ``kwargs`` is ``{"num_gpus": 0, "resources": {"CPU": 1}}`` for a non-GPU
     key, and Ray refuses ``"CPU"`` inside ``resources`` ("Use the 'num_cpus'
     ... keyword instead"); ``num_cpus`` cannot be passed twice either;
  2. each worker reports its devices as
     ``ray.get_runtime_context().get_accelerator_ids()[key]``, and Ray lists
     accelerators only (GPU, TPU, NPU, ...), never ``"CPU"``: a KeyError.

How (the smallest change that gets past both; everything else is vLLM's Ray
executor unchanged, with its placement group, actors, message queues and
collective RPCs):
  - ``ray_device_key = "CPU"``: the placement group gets one ``{"CPU": 1}``
    bundle per rank, so Ray still reserves a core per worker;
  - the actor asks for no resources of its own (``num_gpus=0``; vLLM already
    passes ``num_cpus=0``); its bundle index places it;
  - a worker's "physical device id" is its rank (vLLM uses it only to map
    local ranks to CUDA devices, which the CPU worker ignores).

Applied in the test process (which runs vLLM's engine core in-process, so the
executor is created there) and in every Ray worker process through Ray's
``worker_process_setup_hook`` (see the ``ray_cluster`` fixture).

Remove when: vLLM's CPU platform supports Ray (a non-empty ``ray_device_key``
whose actor options Ray accepts). ``apply`` asserts the patched names still
exist and the key is still empty, so an upstream change fails loudly here.
"""

from __future__ import annotations

SEED_SHIFT = 1  # what the planted rank-dependent seed adds on rank 1


def apply() -> None:
    import ray
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2 as rx

    if getattr(CpuPlatform, "_dsbd_ray_shim", False):
        return
    assert CpuPlatform.ray_device_key == "", "vLLM's CPU platform has a Ray device key now: drop this shim"
    assert hasattr(rx.RayExecutorV2, "_get_actor_resource_kwargs"), "vLLM's Ray executor moved: revisit the shim"
    assert hasattr(rx.RayWorkerProc, "get_node_and_physical_gpu_ids"), "vLLM's Ray worker moved: revisit the shim"

    def node_and_device_ids(self) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), [self._init_kwargs["rank"]]

    CpuPlatform.ray_device_key = "CPU"
    rx.RayExecutorV2._get_actor_resource_kwargs = staticmethod(lambda: {"num_gpus": 0})
    rx.RayWorkerProc.get_node_and_physical_gpu_ids = node_and_device_ids
    CpuPlatform._dsbd_ray_shim = True


# What the Ray tests run on every rank through ``collective_rpc``: functions of a
# module the Ray workers can import (tests/ is on their path), never of a test module.


def worker_pid(worker) -> int:
    import os

    return os.getpid()


def plant_rank_dependent_seed(worker, on: bool) -> None:
    """A planted bug, run on every rank through ``collective_rpc``: rank 1 seeds its
    DSBD generators from ``seed + SEED_SHIFT``, so its sampled decisions differ."""
    from vllm_dsbd.engine import beam_step, spec_step

    for module, name in ((beam_step, "group_generator"), (spec_step, "generator")):
        original = getattr(module, "_unplanted_" + name, None) or getattr(module, name)
        setattr(module, "_unplanted_" + name, original)
        if on and worker.rank == 1:
            setattr(module, name, lambda seed, *rest, _f=original: _f(seed + SEED_SHIFT, *rest))
        else:
            setattr(module, name, original)
