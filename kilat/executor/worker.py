"""One rank's worker: joins the ranks of the model (tensor-parallel group, pipeline stage), then holds that rank's
model runner."""

from __future__ import annotations

import logging

import torch

from kilat.bench.mbu import kv_bytes_per_token, weight_bytes
from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.distributed.parallel_state import init_distributed
from kilat.executor.abstract import WorkerInfo
from kilat.model_executor.cpu_threads import take_cpu_share
from kilat.model_executor.model_runner import ModelRunner

logger = logging.getLogger("kilat")


class Worker:
    """Loads the model and its KV cache on one rank and runs the steps sent to it (vLLM's ``Worker``).

    With several ranks it first joins them (:func:`init_distributed`), takes its share of the CPU cores (or its
    GPU), and seeds torch's generator with ``ModelConfig.seed``: every tensor-parallel rank of the last stage
    samples from the same gathered logits with the same random numbers, so all keep the same tokens.

    Args:
        config: validated engine configuration.
        rank: this worker's global rank (:class:`~kilat.config.ParallelConfig` numbers them).
        distributed_init_method: the group's rendezvous (``tcp://host:port``); unused for one rank.
        device_index: the CUDA device this rank takes (default: its rank; Ray makes the one GPU it grants an
            actor device 0).

    Raises:
        ValueError: as :class:`~kilat.model_executor.model_runner.ModelRunner` (model, KV cache size), or a
            model that ``tensor_parallel_size`` cannot split (features).
    """

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None,
                 device_index: int | None = None):
        self.rank = rank
        world = config.parallel.world_size
        device = torch.device(config.device)
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(rank if device_index is None else device_index)
            else:
                config = take_cpu_share(config, rank, world, "rank")
            torch.manual_seed(config.model.seed)
            parallel = config.parallel
            init_distributed(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                             distributed_init_method or "", device)
        self.runner = ModelRunner(config)
        if world > 1:
            info = self.info
            logger.info("rank %d of %d: %.1f MiB of weights (read per decode step), a %.1f MiB KV cache (%d blocks)",
                        rank, world, info.weight_bytes / 2**20, info.bytes_per_block * info.num_blocks / 2**20,
                        info.num_blocks)

    @property
    def info(self) -> WorkerInfo:
        """The loaded model's limits and KV cache, as plain data."""
        runner = self.runner
        return WorkerInfo(hf_config=runner.hf_config, dtype=str(runner.dtype).removeprefix("torch."),
                          weight_bytes=weight_bytes(runner.model), kv_bytes_per_token=kv_bytes_per_token(runner),
                          max_model_len=runner.max_model_len,
                          num_blocks=runner.num_blocks, num_lookahead_tokens=runner.num_lookahead_tokens,
                          kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
                          bytes_per_block=runner.bytes_per_block, sliding_windows=runner.sliding_windows,
                          kv_cache_groups=runner.kv_cache_groups)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (:meth:`ModelRunner.execute`)."""
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        """Finish what the runner has queued (:meth:`ModelRunner.shutdown`)."""
        self.runner.shutdown()
