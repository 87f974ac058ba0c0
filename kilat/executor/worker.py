"""One rank's worker: joins the tensor-parallel group, then holds that rank's model runner."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from kilat.bench.mbu import kv_bytes_per_token, weight_bytes
from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.distributed.parallel_state import init_tensor_parallel
from kilat.executor.abstract import WorkerInfo
from kilat.model_executor.model_runner import ModelRunner

logger = logging.getLogger("kilat")


def _split_cpu_cores(config: EngineConfig, rank: int) -> EngineConfig:
    """Give rank ``rank`` its own contiguous share of this process's CPU cores (``os.sched_setaffinity``), so
    that the ranks' torch threads do not take each other's cores; with fewer cores than ranks, one thread
    each. Returns ``config`` with ``num_threads`` set for the latter case."""
    world = config.parallel.world_size
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // world
    if share == 0:
        logger.warning("tensor parallel: %d ranks on %d cores; one thread each, unpinned", world, len(cores))
        return dataclasses.replace(config, num_threads=1)
    mine = cores[rank * share:(rank + 1) * share]
    os.sched_setaffinity(0, mine)
    num_threads = None if config.num_threads is None else min(config.num_threads, share)
    logger.info("tensor parallel: rank %d runs on CPU cores %s", rank, mine)
    return dataclasses.replace(config, num_threads=num_threads)


class Worker:
    """Loads the model and its KV cache on one rank and runs the steps sent to it (vLLM's ``Worker``).

    With several ranks it first joins the tensor-parallel group (:func:`init_tensor_parallel`), takes its share
    of the CPU cores (or its GPU), and seeds torch's generator with ``ModelConfig.seed``: every rank samples
    from the same gathered logits with the same random numbers, so all keep the same tokens.

    Args:
        config: validated engine configuration.
        rank: this worker's tensor-parallel rank.
        distributed_init_method: the group's rendezvous (``tcp://host:port``); unused for one rank.

    Raises:
        ValueError: as :class:`~kilat.model_executor.model_runner.ModelRunner` (model, KV cache size), or a
            model that ``tensor_parallel_size`` cannot split (heads, features).
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None):
        self.rank = rank
        world = config.parallel.world_size
        device = torch.device(config.device)
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(rank)
            else:
                config = _split_cpu_cores(config, rank)
            torch.manual_seed(config.model.seed)
            init_tensor_parallel(rank, world, distributed_init_method or "", device)
        self.runner = ModelRunner(config)

    @property
    def info(self) -> WorkerInfo:
        """The loaded model's limits and KV cache, as plain data."""
        runner = self.runner
        return WorkerInfo(hf_config=runner.hf_config, dtype=str(runner.dtype).removeprefix("torch."),
                          weight_bytes=weight_bytes(runner.model), kv_bytes_per_token=kv_bytes_per_token(runner),
                          max_model_len=runner.max_model_len,
                          num_blocks=runner.num_blocks, num_lookahead_tokens=runner.num_lookahead_tokens,
                          kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
                          bytes_per_block=runner.bytes_per_block)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (:meth:`ModelRunner.execute`)."""
        return self.runner.execute(sched)
