"""The HTTP server's settings (:class:`ServerConfig`), in a module of their own so that the CLI reads their
defaults without importing the server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kilat.config import MAX_ENGINE_CORE_RESTARTS
from kilat.entrypoints.openai.reasoning import ReasoningParser
from kilat.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS


@dataclass
class ServerConfig:
    """HTTP server settings.

    Attributes:
        host: address to bind; loopback unless told otherwise.
        port: TCP port, 0-65535 (0: any free port).
        served_model_name: names clients may pass as ``model``; default: the model path or
            ``"SmolLM2-135M-Instruct"`` for the embedded model.
        api_key: when set, ``Authorization: Bearer <api_key>`` is required on ``/v1/*``, ``/tokenize`` and
            ``/detokenize``.
        max_request_body_bytes: larger request bodies get 413 (bytes).
        trust_request_chat_template: accept a ``chat_template`` in chat requests (it runs on the server).
        tool_call_parser: how ``tool_choice: "auto"`` outputs are parsed for tool calls (``"hermes"``), or
            ``None`` (then ``auto`` is refused; ``required`` and named choices work without it).
        reasoning_parser: how chat outputs are split into reasoning and answer
            (:data:`~kilat.entrypoints.openai.reasoning.REASONING_PARSERS`), or ``None`` (all answer).
        reasoning_parser_config: the parser's tags, ``{"start": ..., "end": ...}``, as a dict or its JSON text
            (required for ``"tags"``).
        uvicorn_log_level: uvicorn's log level.
        disable_uvicorn_access_log: do not log one line per HTTP request.
        max_engine_core_restarts: most restarts of a dead engine core in a row before the server exits
            non-zero; 0 exits at the first death (for a supervisor to restart the server).

    Raises:
        ValueError: an invalid value, named.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    reasoning_parser_config: str | dict[str, Any] | None = None
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    max_engine_core_restarts: int = MAX_ENGINE_CORE_RESTARTS

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.max_engine_core_restarts < 0:
            raise ValueError(f"max_engine_core_restarts must be >= 0, got {self.max_engine_core_restarts}")
        if isinstance(self.reasoning_parser_config, str):
            try:
                self.reasoning_parser_config = json.loads(self.reasoning_parser_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"reasoning_parser_config must be a JSON object: {e}") from None
        if self.reasoning_parser_config is not None and not isinstance(self.reasoning_parser_config, dict):
            raise ValueError(f"reasoning_parser_config must be a JSON object, got "
                             f"{type(self.reasoning_parser_config).__name__}")
        if self.reasoning_parser_config is not None and self.reasoning_parser is None:
            raise ValueError("reasoning_parser_config needs reasoning_parser")
        self.build_reasoning_parser()  # validates the name and the tags

    def build_reasoning_parser(self) -> ReasoningParser | None:
        """The chat endpoint's reasoning parser, or ``None``.

        Raises:
            ValueError: an unknown parser or invalid tags (named).
        """
        if self.reasoning_parser is None:
            return None
        config = self.reasoning_parser_config if isinstance(self.reasoning_parser_config, dict) else None
        return ReasoningParser.create(self.reasoning_parser, config)
