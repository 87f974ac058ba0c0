"""Engine configuration: small dataclasses, each validated on construction.

Field names follow vLLM's engine arguments (``max_model_len``, ``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``gpu_memory_utilization``, ``enable_prefix_caching``) so that users can
carry their flags over unchanged. Every invalid value raises ``ValueError`` naming the field and the
allowed range.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import torch

logger = logging.getLogger("kilat")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
MAX_ENGINE_CORE_RESTARTS = 3
"""Default for the most restarts of a dead engine core in a row (``AsyncLLM``, ``kilat serve``)."""
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``kv_cache_dtype`` values (vLLM's names; ``fp8`` is ``fp8_e4m3``)."""


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name} {message}")


@dataclass
class ModelConfig:
    """What model to run and in which dtype.

    Attributes:
        model: an HF directory (config.json + *.safetensors), a ``.gguf`` file, a JSON config file (with
            ``load_format="dummy"``), or ``None`` / ``"smollm2-135m-instruct"`` for the embedded model.
        tokenizer: tokenizer directory or GGUF file; defaults to ``model``.
        dtype: ``"auto"`` (bfloat16 on CPU and CUDA when the checkpoint is 16-bit or quantized, else the
            checkpoint dtype), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        load_format: ``"auto"`` (by path), ``"hf"``, ``"gguf"`` or ``"dummy"`` (random weights).
        max_model_len: longest context in tokens (prompt + output); ``None`` takes the model's
            ``max_position_embeddings``.
        seed: seed for dummy weights and for unseeded sampling.
        skip_tokenizer_init: load no tokenizer (vLLM's flag): prompts must be token ids, outputs carry token
            ids and empty text, stop strings are refused. For dummy shapes that have no tokenizer.
        quantization: how linear weights are stored and multiplied (vLLM's ``--quantization``): ``None``
            takes the checkpoint's own (config.json ``quantization_config``) or none; ``"int8"`` / ``"int4"``
            quantize a 16/32-bit checkpoint at load; ``"gguf"`` keeps a GGUF file's blocks. See
            docs/quantization.md.
        quantization_config: the method's settings as a dict or its JSON text, e.g. ``{"group_size": 64}``
            for ``int4``; they override a checkpoint's own.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    quantization_config: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            from kilat.model_executor.layers.quantization import QUANTIZATION_METHODS

            _check(self.quantization in QUANTIZATION_METHODS, "quantization",
                   f"must be one of {sorted(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        if isinstance(self.quantization_config, str):
            try:
                self.quantization_config = json.loads(self.quantization_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"quantization_config must be a JSON object: {e}") from None
        _check(self.quantization_config is None or isinstance(self.quantization_config, dict),
               "quantization_config", f"must be a JSON object, got {type(self.quantization_config).__name__}")
        _check(self.dtype == "auto" or self.dtype in _DTYPES, "dtype",
               f"must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        _check(self.load_format in LOAD_FORMATS, "load_format",
               f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               f"must be >= 1, got {self.max_model_len}")


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """Turn a ``dtype`` string into a torch dtype.

    ``"auto"`` keeps a float32 checkpoint in float32 only when the checkpoint says so explicitly;
    16-bit and quantized (GGUF) checkpoints run in bfloat16, which is fastest on AVX-512-bf16 CPUs and
    on GPUs. ``checkpoint_dtype`` is ``None`` when the checkpoint does not state one.
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if checkpoint_dtype == torch.float32:
        return torch.float32
    if checkpoint_dtype == torch.float16:
        return torch.float16
    return torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """A ``dtype`` string naming a torch dtype (the inverse of :func:`resolve_dtype` for explicit names).

    Raises:
        KeyError: a dtype kilat does not run in.
    """
    return _DTYPE_NAMES[dtype]


@dataclass
class CacheConfig:
    """Paged KV cache sizing (PagedAttention, Kwon et al., SOSP 2023).

    Attributes:
        block_size: token slots per KV block.
        kv_cache_memory: bytes given to the KV cache on CPU; ``None`` means 2 GiB. Per worker: each
            tensor-parallel rank allocates this much for its own heads.
        gpu_memory_utilization: fraction of device memory for weights + activations + KV cache on CUDA.
        enable_prefix_caching: reuse KV blocks of previously computed full-block prefixes.
        num_gpu_blocks_override: exact number of KV blocks (tests and benchmarks), overriding both sizes.
        kv_cache_dtype: what the KV cache stores: ``"auto"`` (the model dtype), ``"int8"`` (symmetric, a float32
            scale per token and KV head), ``"fp8"`` / ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (float8 with the same
            scales). Fewer bytes per token, so more blocks fit; fp8 needs the CPU or, with the Triton backend,
            CUDA compute capability 8.9 or newer.
        kv_offloading_size: GiB of the KV offload tier (vLLM's flag; least recently used blocks go first): the
            full blocks of requests that end or are preempted are saved there, and a later prompt that starts
            with them loads them back instead of recomputing them (``None``: no tier). Needs
            ``kv_offloading_path`` (the disk tier; a host-memory tier for GPUs is not built yet) and prefix
            caching.
        kv_offloading_path: directory of the disk tier (created if missing; its blocks survive restarts and are
            shared by engines of the same model and KV layout).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    kv_offloading_size: float | None = None
    kv_offloading_path: str | None = None

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
               f"must be a power of two in [1, 256], got {self.block_size}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
               f"must be > 0 bytes, got {self.kv_cache_memory}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
               "num_gpu_blocks_override", f"must be >= 2, got {self.num_gpu_blocks_override}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.kv_offloading_size is None or self.kv_offloading_size > 0, "kv_offloading_size",
               f"must be > 0 GiB, got {self.kv_offloading_size}")
        _check((self.kv_offloading_size is None) == (self.kv_offloading_path is None), "kv_offloading_size",
               "and kv_offloading_path go together (the tier's size in GiB and its directory)")
        _check(self.kv_offloading_size is None or self.enable_prefix_caching, "kv_offloading_size",
               "needs enable_prefix_caching (the tier holds prefix-cache blocks)")


SCHEDULING_POLICIES = ("fcfs", "priority")
"""``scheduling_policy`` values (:mod:`kilat.core.request_queue`)."""


@dataclass
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prompt chunks + decode tokens).
        enable_chunked_prefill: split prompts longer than the remaining budget over several steps.
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"priority"`` (by each request's ``priority``, lower
            first, then arrival; preemption takes the lowest priority, newest first); see
            :mod:`kilat.core.request_queue`.
        admission_headroom: admit a waiting request only if, after its blocks, one free block per running
            request (per KV-cache group) and 1% of the cache stay free, so that running decodes can grow a block
            each before anything is preempted (long, unpredictable decodes otherwise thrash: admit, preempt,
            recompute). A request is always admitted when nothing runs.
        async_scheduling: schedule step n+1 while step n runs (vLLM's ``--async-scheduling``): a decoding
            request is scheduled again before its sampled token is known (the runner, which ran step n first,
            takes it from its own state), and the engine learns each token one step later for stop checks,
            streaming and metrics. Greedy outputs are unchanged. Off by default: on the CPU the steps still run
            one after the other on the engine's thread (the model's threads hold every core, so an overlap would
            cost the forward what it saves: docs/benchmarks.md, "Async scheduling"), and on CUDA, where a thread
            runs each step while the next is scheduled, it is not measured yet. A request with a grammar or a
            thinking budget is scheduled only once its last token is known. Not with speculative decoding, pipeline
            parallelism or a KV connector (yet).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    admission_headroom: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


@dataclass
class ExecutionConfig:
    """How the model's steps are executed.

    Attributes:
        attention_backend: ``"auto"`` (the fastest available: Triton on CUDA when installed, the C++ ``"cpu"``
            backend on the CPU when its kernels build (any cache dtype), else the torch
            reference), ``"torch"``, ``"cpu"`` or ``"triton"`` (off CUDA only under ``TRITON_INTERPRET=1``, for
            tests); see :mod:`kilat.model_executor.attention.backends`.
        enforce_eager: never capture CUDA graphs (by default decode steps replay graphs captured for batch
            sizes 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs`` on CUDA with a graphable backend).
    """

    attention_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix", "eagle3")


@dataclass
class ParallelConfig:
    """How the model is split and where its workers run (vLLM's ``ParallelConfig``).

    Ranks are numbered stage-major: rank ``r`` is tensor-parallel rank ``r % tensor_parallel_size`` of pipeline
    stage ``r // tensor_parallel_size``.

    Attributes:
        tensor_parallel_size: ranks that split every layer (attention heads, MLP features, vocabulary), each a
            worker process; the ranks' partial results are summed with torch.distributed collectives (gloo on
            the CPU, NCCL on CUDA).
        pipeline_parallel_size: stages that each hold a contiguous range of the decoder layers, in worker
            processes of their own; a stage sends its hidden states to the next, and as many steps as there are
            stages are in flight at once so that the stages overlap.
        data_parallel_size: engine cores behind one server (``kilat serve``), each a whole copy of the model
            (with its own tensor and pipeline ranks) on its own share of the CPU cores or GPUs; each request goes
            to the engine with the longest prefix-cache match when that is worth it, else to the least loaded
            (:mod:`kilat.engine.dp_router`). The offline ``LLM`` runs one engine.
        distributed_executor_backend: ``"uni"`` (one worker in the engine core's process), ``"mp"`` (each
            worker in a process of its own; the engine core sends every step to them over ZMQ), ``"ray"`` (each
            worker a Ray actor, on this machine or across the machines of a Ray cluster: ``RAY_ADDRESS``; needs
            ``pip install 'kilat[ray]'``), or ``None`` (``"uni"`` for one rank, else ``"mp"``), as vLLM's
            ``--distributed-executor-backend``.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        from kilat.executor import EXECUTOR_BACKENDS

        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _check(self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS), "distributed_executor_backend",
               f"must be one of {sorted(EXECUTOR_BACKENDS)} or None, got {self.distributed_executor_backend!r}")
        _check(self.distributed_executor_backend != "ray" or importlib.util.find_spec("ray") is not None,
               "distributed_executor_backend", "'ray' needs Ray, which is not installed: pip install 'kilat[ray]' "
               "(or use 'mp' on one machine)")
        _check(self.distributed_executor_backend != "uni" or self.world_size == 1, "distributed_executor_backend",
               f"'uni' runs one worker; tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
               f"{self.pipeline_parallel_size} needs 'mp' (or 'ray')")

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) one engine runs: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step results are the engine's: tensor-parallel rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        """:attr:`distributed_executor_backend` resolved: when it is ``None``, ``"uni"`` for one rank, else
        ``"mp"``."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def check_model(self, hf_config: Any) -> None:
        """Refuse a split the model cannot take (read from its config, before any worker starts).

        Raises:
            ValueError: ``tensor_parallel_size`` does not divide the attention heads, neither divides nor is a
                multiple of the key/value heads, or is above 1 for a model of multi-head latent attention (an HF
                config with ``kv_lora_rank``: DeepSeek-V2/V3), or ``pipeline_parallel_size`` exceeds the decoder
                layers.
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        _check(tp == 1 or getattr(hf_config, "kv_lora_rank", None) is None, "tensor_parallel_size",
               f"({tp}) must be 1 for multi-head latent attention (DeepSeek-V2/V3) for now")
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        _check(heads % tp == 0, "tensor_parallel_size", f"({tp}) must divide num_attention_heads ({heads})")
        _check(kv_heads % tp == 0 or tp % kv_heads == 0, "tensor_parallel_size",
               f"({tp}) must divide num_key_value_heads ({kv_heads}) or be a multiple of it")
        _check(pp <= hf_config.num_hidden_layers, "pipeline_parallel_size",
               f"({pp}) must be <= the model's num_hidden_layers ({hf_config.num_hidden_layers})")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al., ICML 2023): a proposer drafts tokens, the target verifies them.

    Attributes:
        method: ``"ngram"`` (prompt lookup: copy the tokens that followed the latest earlier occurrence of the
            sequence's last n tokens), ``"draft_model"`` (a smaller model with the same vocabulary), ``"suffix"``
            (suffix decoding: the most frequent continuation of the sequence's longest recurring suffix, in its own
            tokens and in earlier requests' outputs; :mod:`kilat.spec_decode.suffix`) or ``"eagle3"`` (an EAGLE-3
            head that drafts from the target's own hidden states; :mod:`kilat.spec_decode.eagle3`).
        num_speculative_tokens: most draft tokens per request and step (k).
        model: the draft model for ``"draft_model"`` (as :attr:`ModelConfig.model`; ``None`` is the embedded
            SmolLM2-135M-Instruct), the head's directory for ``"eagle3"`` (required; vLLM's checkpoint layout,
            as ``kilat train-draft`` writes it); must be ``None`` for the other methods.
        load_format: the draft model's load format (as :attr:`ModelConfig.load_format`).
        quantization: an online method for the EAGLE-3 head's weights (``"int8"`` or ``"int4"``, as
            :attr:`ModelConfig.quantization`; ``None``: dense in the target's dtype). Drafting is bound by the
            head's weight reads on a CPU; a rounded head only drafts differently, the outputs stay the target's.
        prompt_lookup_min: shortest suffix n-gram looked up (tokens, ``"ngram"``).
        prompt_lookup_max: longest suffix n-gram looked up (tokens, ``"ngram"``); longer matches are tried first.
        suffix_decoding_max_tree_depth: longest suffix matched (tokens, ``"suffix"``; vLLM's knobs).
        suffix_decoding_max_cached_requests: finished requests whose outputs the global cache keeps (``"suffix"``;
            0: none, only the request's own tokens are searched).
        suffix_decoding_max_spec_factor: at most this many draft tokens per matched token (``"suffix"``).
        suffix_decoding_min_token_prob: the smallest frequency, among the matched occurrences that agree with the
            draft so far, of a drafted token (``"suffix"``).
        disable_by_batch_size: a step that holds more requests than this drafts for none of them (vLLM's knob):
            speculation trades compute for fewer steps, which pays at small batches only (on the 2-core CPU, W6 at
            concurrency 16 ran at 0.84-0.88× with drafts, 0.98-0.99× with this at 4: docs/speculative_decoding.md);
            ``None``: always draft.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check(self.method in SPECULATIVE_METHODS, "speculative_config.method",
               f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
               "speculative_config.num_speculative_tokens", f"must be in [1, 16], got {self.num_speculative_tokens}")
        _check(self.load_format in LOAD_FORMATS, "speculative_config.load_format",
               f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(self.method in ("draft_model", "eagle3") or self.model is None, "speculative_config.model",
               f"is only used with methods 'draft_model' and 'eagle3', got {self.model!r}")
        _check(self.method != "eagle3" or isinstance(self.model, str), "speculative_config.model",
               "must name the directory of the EAGLE-3 head with method 'eagle3'")
        _check(self.quantization in (None, "int8", "int4") and (self.quantization is None or self.method == "eagle3"),
               "speculative_config.quantization", f"must be None, or 'int8' or 'int4' with method 'eagle3', got "
               f"{self.quantization!r}")
        _check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
               "speculative_config.prompt_lookup_min", f"must be >= 1, got {self.prompt_lookup_min}")
        _check(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "speculative_config.prompt_lookup_max",
               f"must be >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max}")
        _check(isinstance(self.suffix_decoding_max_tree_depth, int) and 1 <= self.suffix_decoding_max_tree_depth
               <= 256, "speculative_config.suffix_decoding_max_tree_depth",
               f"must be in [1, 256], got {self.suffix_decoding_max_tree_depth}")
        _check(isinstance(self.suffix_decoding_max_cached_requests, int) and
               0 <= self.suffix_decoding_max_cached_requests <= 1_000_000,
               "speculative_config.suffix_decoding_max_cached_requests",
               f"must be in [0, 1000000], got {self.suffix_decoding_max_cached_requests}")
        _check(isinstance(self.suffix_decoding_max_spec_factor, (int, float)) and
               0 < self.suffix_decoding_max_spec_factor <= 64, "speculative_config.suffix_decoding_max_spec_factor",
               f"must be in (0, 64], got {self.suffix_decoding_max_spec_factor}")
        _check(isinstance(self.suffix_decoding_min_token_prob, (int, float)) and
               0 <= self.suffix_decoding_min_token_prob <= 1, "speculative_config.suffix_decoding_min_token_prob",
               f"must be in [0, 1], got {self.suffix_decoding_min_token_prob}")
        _check(self.disable_by_batch_size is None or (isinstance(self.disable_by_batch_size, int) and
                                                      self.disable_by_batch_size >= 1),
               "speculative_config.disable_by_batch_size", f"must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """Build from a dict or its JSON text (``--speculative-config '{"method": "ngram", ...}'``).

        Raises:
            ValueError: invalid JSON, an unknown key or an invalid value, named.
        """
        value = _json_object(cls, "speculative_config", value)
        missing = sorted(n for n in ("method", "num_speculative_tokens") if n not in value)
        if missing:
            raise ValueError(f"speculative_config: missing required key(s) {missing}")
        return cls(**value)


def _json_object(cls: type, name: str, value: str | dict[str, Any]) -> dict[str, Any]:
    """``value`` (a dict or its JSON text) as a dict of ``cls``'s fields.

    Raises:
        ValueError: invalid JSON, not an object, or an unknown key, named after ``name``.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(names)}")
    return value


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
"""What an instance does in disaggregated prefill/decode (vLLM's ``kv_role`` values)."""


@dataclass
class KVTransferConfig:
    """Disaggregated prefill/decode (``--kv-transfer-config``, a JSON object; vLLM's ``KVTransferConfig`` keys).

    A producer (the prefill instance) keeps the KV blocks of a request sent with ``kv_transfer_params``
    ``{"do_remote_decode": true}`` after it finishes, and serves them on ``kv_ip:kv_port``; a consumer (the decode
    instance) given the ``kv_transfer_params`` the producer returned pulls them instead of computing the prompt
    (:mod:`kilat.kv_connector.tcp`).

    Attributes:
        kv_connector: the connector's name: ``"TcpConnector"`` (kilat's, over TCP).
        kv_role: ``"kv_producer"``, ``"kv_consumer"`` or ``"kv_both"`` (either, per request).
        kv_ip: the address a producer binds and tells consumers to pull from (this machine's address that the
            decode instances reach; the loopback default serves one machine only).
        kv_port: the TCP port a producer serves its blocks on (each producer on a machine needs its own).
        engine_id: this instance's name in ``kv_transfer_params`` (``None``: a random one per server start,
            so a restarted server is never mistaken for the old one; an engine core the server restarts keeps
            it, and refuses pulls of the blocks the old core kept).
        kv_connector_extra_config: the connector's own settings: ``abort_request_timeout`` (seconds a
            producer keeps a request's blocks for its consumer, default 120; then they are freed and the
            consumer computes the prompt itself) and ``transfer_timeout`` (seconds either side waits for any one
            read or write of a pull, default 30; a consumer then computes the rest of the prompt itself).
    """

    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.kv_connector in TRANSFER_CONNECTORS, "kv_transfer_config.kv_connector",
               f"must be one of {TRANSFER_CONNECTORS}, got {self.kv_connector!r}")
        _check(self.kv_role in KV_ROLES, "kv_transfer_config.kv_role",
               f"must be one of {KV_ROLES}, got {self.kv_role!r}")
        _check(isinstance(self.kv_ip, str) and 0 < len(self.kv_ip) <= 255, "kv_transfer_config.kv_ip",
               f"must be a host name or address, got {self.kv_ip!r}")
        _check(isinstance(self.kv_port, int) and not isinstance(self.kv_port, bool) and 1 <= self.kv_port <= 65535,
               "kv_transfer_config.kv_port", f"must be in [1, 65535], got {self.kv_port!r}")
        _check(self.engine_id is None or (isinstance(self.engine_id, str) and 0 < len(self.engine_id) <= 128),
               "kv_transfer_config.engine_id", f"must be a string of 1 to 128 characters, got {self.engine_id!r}")
        extra = self.kv_connector_extra_config
        _check(isinstance(extra, dict), "kv_transfer_config.kv_connector_extra_config",
               f"must be an object, got {extra!r}")
        unknown = sorted(set(extra) - set(TRANSFER_EXTRA_DEFAULTS))
        _check(not unknown, "kv_transfer_config.kv_connector_extra_config",
               f"unknown key(s) {unknown}; known: {sorted(TRANSFER_EXTRA_DEFAULTS)}")
        for key, value in extra.items():
            _check(isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 3600,
                   f"kv_transfer_config.kv_connector_extra_config.{key}", f"must be in (0, 3600] s, got {value!r}")
        if self.engine_id is None:
            self.engine_id = uuid.uuid4().hex

    def extra(self, key: str) -> float:
        """A ``kv_connector_extra_config`` setting, or its default."""
        return self.kv_connector_extra_config.get(key, TRANSFER_EXTRA_DEFAULTS[key])

    @property
    def is_producer(self) -> bool:
        """Whether this instance serves its blocks to consumers."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Whether this instance pulls blocks from producers."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """Build from a dict or its JSON text (``--kv-transfer-config '{"kv_role": "kv_producer"}'``).

        Raises:
            ValueError: invalid JSON, an unknown key or an invalid value, named.
        """
        return cls(**_json_object(cls, "kv_transfer_config", value))


TRANSFER_CONNECTORS = ("TcpConnector",)
"""The connectors ``kv_transfer_config.kv_connector`` can name."""

TRANSFER_EXTRA_DEFAULTS = {"abort_request_timeout": 120.0, "transfer_timeout": 30.0}
"""``kv_connector_extra_config`` keys and their defaults in seconds (:class:`KVTransferConfig`)."""


@dataclass
class StructuredOutputsConfig:
    """How the engine core compiles structured-outputs grammars (``--structured-outputs-config``, a JSON
    object; vLLM has the flag and ``backend``, the other keys are kilat's).

    Attributes:
        backend: the grammar backend, vLLM's key: ``"auto"`` or ``"xgrammar"`` (kilat's only one; both mean
            xgrammar).
        compile_timeout_s: most seconds one grammar may take to compile; a request whose grammar takes longer
            ends with finish reason ``abort`` and an error naming this limit.
        cache_size_mb: most MiB of compiled grammars kept for reuse (xgrammar's ``memory_size_bytes``), least
            recently used out first.
        num_workers: grammar compiles at once, each in a worker process of its own (killed when its requests
            go away or time runs out).
    """

    backend: str = "auto"
    compile_timeout_s: float = 10.0
    cache_size_mb: int = 512
    num_workers: int = 2

    def __post_init__(self) -> None:
        _check(self.backend in ("auto", "xgrammar"), "structured_outputs_config.backend",
               f"must be 'auto' or 'xgrammar' (the only backend kilat has), got {self.backend!r}")
        _check(isinstance(self.compile_timeout_s, int | float) and 0 < self.compile_timeout_s <= 3600,
               "structured_outputs_config.compile_timeout_s", f"must be in (0, 3600], got {self.compile_timeout_s}")
        _check(isinstance(self.cache_size_mb, int) and self.cache_size_mb >= 0,
               "structured_outputs_config.cache_size_mb", f"must be an integer >= 0, got {self.cache_size_mb}")
        _check(isinstance(self.num_workers, int) and 1 <= self.num_workers <= 64,
               "structured_outputs_config.num_workers", f"must be in [1, 64], got {self.num_workers}")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> StructuredOutputsConfig:
        """Build from a dict or its JSON text (``--structured-outputs-config '{"compile_timeout_s": 5}'``).

        Raises:
            ValueError: invalid JSON, an unknown key or an invalid value, named.
        """
        return cls(**_json_object(cls, "structured_outputs_config", value))


@dataclass
class EngineArgs:
    """Flat engine arguments, as accepted by ``LLM(...)`` and the CLI (vLLM's names).

    ``create_engine_config`` splits them into the validated per-component configs. Each field that a config
    class owns takes its default from that class and is documented there (``kilat serve --help`` shows those
    docs); the fields below belong to the engine itself.

    Attributes:
        device: ``"auto"`` (CUDA when available, else the CPU), ``"cpu"`` or ``"cuda"``.
        num_threads: torch threads on the CPU; ``None`` adapts: one per core, less one per core that a foreign
            process has held (0.4 core or more) for 3 s, re-measured every second. Foreign: any process but
            the engine core and its frontend (the API process, or the offline user's) with the frontend's
            other children; the core's own grammar-compile workers count, as they really hold a core
            (docs/benchmarks.md says why).
        speculative_config: speculative decoding, as a dict of :class:`SpeculativeConfig` fields or its JSON
            text, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``; ``None`` turns it off.
        structured_outputs_config: grammar compiles, as a dict of :class:`StructuredOutputsConfig` fields or its
            JSON text, e.g. ``{"compile_timeout_s": 5, "cache_size_mb": 256}``; ``None`` keeps the defaults.
        kv_transfer_config: disaggregated prefill/decode, as a dict of :class:`KVTransferConfig` fields or its
            JSON text, e.g. ``{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 14579}``;
            ``None`` turns it off.
    """

    model: str | None = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    load_format: str = ModelConfig.load_format
    max_model_len: int | None = ModelConfig.max_model_len
    seed: int = ModelConfig.seed
    skip_tokenizer_init: bool = ModelConfig.skip_tokenizer_init
    quantization: str | None = ModelConfig.quantization
    quantization_config: str | dict[str, Any] | None = ModelConfig.quantization_config
    block_size: int = CacheConfig.block_size
    kv_cache_memory: int | None = field(default=CacheConfig.kv_cache_memory, metadata={"size": True})
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    kv_offloading_size: float | None = CacheConfig.kv_offloading_size
    kv_offloading_path: str | None = CacheConfig.kv_offloading_path
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    scheduling_policy: str = SchedulerConfig.scheduling_policy
    admission_headroom: bool = SchedulerConfig.admission_headroom
    async_scheduling: bool = SchedulerConfig.async_scheduling
    device: str = "auto"
    num_threads: int | None = None
    attention_backend: str = ExecutionConfig.attention_backend
    enforce_eager: bool = ExecutionConfig.enforce_eager
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    speculative_config: str | dict[str, Any] | None = None
    structured_outputs_config: str | dict[str, Any] | None = None
    kv_transfer_config: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), "device",
               f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               f"must be >= 1, got {self.num_threads}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, rejecting unknown names with a ``ValueError``."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        """Validate and split into an :class:`EngineConfig`.

        Checks what the engine core would otherwise find only after loading the weights: the device exists,
        the attention backend runs on it and can read ``kv_cache_dtype``, ``max_model_len`` fits the model's
        ``max_position_embeddings`` (read from config.json or the GGUF header, not the weights), and the
        quantization method fits the checkpoint, dtype and device. Logs a warning for each flag that the
        device ignores (``gpu_memory_utilization`` and ``enforce_eager`` on the CPU, ``kv_cache_memory`` on
        CUDA).

        Raises:
            ValueError: an invalid value, an unusable device or backend, an unresolvable model,
                ``max_model_len`` above the model's limit, or a quantization that does not fit, named.
        """
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' is not available (torch.cuda.is_available() is False); use "
                             "--device cpu or auto")
        from kilat.model_executor.attention.backends import resolve_attention_backend
        from kilat.model_executor.attention.kv_cache import check_kv_cache_dtype

        # refuse an unusable backend before loading
        backend = resolve_attention_backend(self.attention_backend, device, self.kv_cache_dtype)
        self._warn_ignored(device)
        self._check_max_model_len()

        def build(cls: type) -> Any:
            return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

        speculative = None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)
        structured_outputs = StructuredOutputsConfig.parse(self.structured_outputs_config or {})
        model = build(ModelConfig)
        parallel = build(ParallelConfig)
        _check_quantization(model, device, parallel)
        gpus = parallel.world_size * parallel.data_parallel_size  # on this machine, unless Ray places the ranks
        _check(device != "cuda" or gpus == 1 or parallel.executor_backend == "ray" or gpus <= torch.cuda.device_count(),
               "tensor_parallel_size",
               f"x pipeline_parallel_size x data_parallel_size = {gpus} ranks need as many GPUs (one per rank); "
               f"{torch.cuda.device_count()} visible")
        _check(parallel.world_size == 1 or speculative is None or speculative.method not in ("draft_model", "eagle3"),
               "speculative_config", f"method {speculative and speculative.method!r} runs with tensor_parallel_size "
               f"and pipeline_parallel_size 1 only")
        cache = build(CacheConfig)
        check_kv_cache_dtype(cache.kv_cache_dtype, backend, device)
        _check(cache.kv_offloading_size is None or parallel.world_size * parallel.data_parallel_size == 1,
               "kv_offloading_size", "runs with tensor_parallel_size, pipeline_parallel_size and "
               "data_parallel_size 1 only (for now)")
        kv_transfer = None if self.kv_transfer_config is None else KVTransferConfig.parse(self.kv_transfer_config)
        if kv_transfer is not None:
            _check(cache.kv_offloading_size is None, "kv_transfer_config",
                   "and kv_offloading_size cannot be combined yet (one KV connector per engine)")
            _check(parallel.world_size * parallel.data_parallel_size == 1, "kv_transfer_config",
                   "runs with tensor_parallel_size, pipeline_parallel_size and data_parallel_size 1 only (for now)")
            _check(not kv_transfer.is_consumer or cache.enable_prefix_caching, "kv_transfer_config",
                   f"kv_role {kv_transfer.kv_role!r} needs enable_prefix_caching (pulled blocks join the prefix "
                   f"cache)")
        _check(not self.async_scheduling or (speculative is None and parallel.pipeline_parallel_size == 1 and
                                             kv_transfer is None and cache.kv_offloading_size is None),
               "async_scheduling", "does not run with speculative_config, pipeline_parallel_size > 1, "
               "kv_transfer_config or kv_offloading_size yet")
        return EngineConfig(model=model, cache=cache, scheduler=build(SchedulerConfig),
                            execution=build(ExecutionConfig), parallel=parallel, speculative=speculative,
                            structured_outputs=structured_outputs, kv_transfer=kv_transfer, device=device,
                            num_threads=self.num_threads)

    def _warn_ignored(self, device: str) -> None:
        """Log each flag set to a non-default value that ``device`` does not use."""
        ignored = {"cpu": [("gpu_memory_utilization", CacheConfig.gpu_memory_utilization),
                           ("enforce_eager", ExecutionConfig.enforce_eager)],
                   "cuda": [("kv_cache_memory", CacheConfig.kv_cache_memory)]}[device]
        for name, default in ignored:
            if getattr(self, name) != default:
                logger.warning("%s=%r is ignored on %s", name, getattr(self, name), device.upper())

    def _check_max_model_len(self) -> None:
        """Refuse a ``max_model_len`` above the model's ``max_position_embeddings`` (config metadata only).

        Raises:
            ValueError: the model cannot be resolved, or ``max_model_len`` is too large.
        """
        from kilat.model_executor.loader.metadata import source_max_position_embeddings
        from kilat.model_executor.loader.source import resolve_model_source

        if self.max_model_len is None:
            return
        model_max = source_max_position_embeddings(resolve_model_source(self.model, self.load_format))
        _check(self.max_model_len <= model_max, "max_model_len",
               f"must be <= the model's max_position_embeddings ({model_max}), got {self.max_model_len}")


def _check_quantization(model: ModelConfig, device: str, parallel: ParallelConfig) -> None:
    """Resolve the model's quantization from metadata only (config.json, never the weights), so a method
    that does not fit the checkpoint, dtype, device or tensor parallelism fails before the engine loads anything;
    with several ranks, also check that the model's heads and layers split (:meth:`ParallelConfig.check_model`).

    Raises:
        ValueError: see :func:`kilat.model_executor.layers.quantization.resolve_quantization`; a method whose
            layers cannot be split across ``tensor_parallel_size`` ranks; or a split the model cannot take.
    """
    from kilat.model_executor.layers.quantization import resolve_quantization
    from kilat.model_executor.loader.model_loader import checkpoint_dtype, get_hf_config
    from kilat.model_executor.loader.source import resolve_model_source

    source = resolve_model_source(model.model, model.load_format)
    stated = None if source.kind == "gguf" else checkpoint_dtype(get_hf_config(source))
    quant = resolve_quantization(model.quantization, model.quantization_config, source.kind, source.path,
                                 resolve_dtype(model.dtype, stated), device)
    tp = parallel.tensor_parallel_size
    _check(tp == 1 or quant is None or quant.supports_tensor_parallel, "tensor_parallel_size",
           f"{tp} cannot split quantization {quant.name if quant else None!r} yet (its stored "
           f"format); use an unquantized dtype (for a GGUF file: --dtype float32, the dequantized weights) or a "
           f"method that quantizes at load (int8, int4, fp8)")
    if parallel.world_size > 1:  # a GGUF file's config is its converted folder's (converted once, then cached)
        parallel.check_model(get_hf_config(source))


@dataclass
class EngineConfig:
    """All validated configs of one engine instance.

    ``frontend_pid`` is set by the engine-core process (``run_engine_core``) to the process that started it
    (the API process, or the offline user's): the CPU thread governor counts that process and its other
    children as kilat's own load, not a neighbour's (``None``: an in-process engine, which has no such family).
    An ``mp`` worker process sets it to its parent when it is ``None`` (``kilat.executor.multiproc``).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    kv_transfer: KVTransferConfig | None = None
    device: str = "cpu"
    num_threads: int | None = None
    frontend_pid: int | None = None

    @property
    def kv_connector_name(self) -> str | None:
        """The KV connector this engine runs (:data:`kilat.kv_connector.base.KV_CONNECTORS`), or ``None``."""
        if self.kv_transfer is not None:
            return self.kv_transfer.kv_connector
        return "OffloadingConnector" if self.cache.kv_offloading_size is not None else None
