"""Tensor-parallel process groups and collectives (:mod:`kilat.distributed.parallel_state`), with a
shared-memory all-reduce for ranks on one host (:mod:`kilat.distributed.shm_all_reduce`)."""
