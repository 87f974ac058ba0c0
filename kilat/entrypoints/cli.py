"""The ``kilat`` command line: ``kilat serve`` (OpenAI-compatible server), ``kilat bench`` (benchmarks),
``kilat generate`` and an interactive, streaming ``kilat chat``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from kilat.config import EngineArgs
from kilat.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`EngineArgs` field (``model`` is positional, optional)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory, .gguf file or dummy config; default: embedded SmolLM2-135M-Instruct")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            parser.add_argument(flag, type=kind, default=f.default)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Collect the :class:`EngineArgs` fields from parsed arguments."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _params(ns: argparse.Namespace) -> SamplingParams:
    """Sampling parameters from the flags; ``--seed`` (an engine argument) also seeds each request."""
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.seed)


def _stream(engine: Any, request_id: str) -> str:
    """Step the engine, printing the request's new text as it arrives; return the full text."""
    printed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[len(printed):] if text.startswith(printed) else "\n" + text)
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    return printed


def cmd_generate(ns: argparse.Namespace) -> None:
    """Generate completions of ``--prompt`` (repeatable) and print them."""
    from kilat.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    prompts = ns.prompt or [sys.stdin.read()]
    if ns.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(ns), use_tqdm=False)
    else:
        outputs = llm.generate(prompts, _params(ns), use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)


def cmd_chat(ns: argparse.Namespace) -> None:
    """Interactive chat that streams replies; an empty line or EOF ends it."""
    from kilat.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    engine = llm.engine
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = engine.input_processor.apply_chat_template(messages)
        rid = engine.new_request_id()
        try:
            engine.add_request(rid, prompt, _params(ns), add_special_tokens=False)
        except ValueError as e:
            print(f"error: {e}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": _stream(engine, rid)})


def cmd_serve(ns: argparse.Namespace) -> None:
    """Serve the model over the OpenAI API until SIGINT or SIGTERM."""
    from kilat.entrypoints.openai.api_server import ServerConfig, run_server

    config = ServerConfig(host=ns.host, port=ns.port, served_model_name=ns.served_model_name or [],
                          api_key=ns.api_key, max_request_body_bytes=ns.max_request_body_bytes,
                          trust_request_chat_template=ns.trust_request_chat_template,
                          tool_call_parser=ns.tool_call_parser, uvicorn_log_level=ns.uvicorn_log_level,
                          disable_uvicorn_access_log=ns.disable_uvicorn_access_log)
    run_server(engine_args_from(ns), config)


def _server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model names clients may use (default: the model path, or SmolLM2-135M-Instruct)")
    parser.add_argument("--api-key", default=os.environ.get("KILAT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                             "(default: $KILAT_API_KEY)")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger request bodies get HTTP 413")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat_template in chat requests (it runs on the server)")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                        help="parse tool calls in tool_choice='auto' outputs (hermes: <tool_call>{...}</tool_call>)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The ``kilat`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="kilat", description="Kilat LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API (HTTP)")
    add_engine_args(serve)
    _server_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate completions offline")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with streaming replies")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)
    from kilat.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kilat`` command."""
    ns = build_parser().parse_args(argv)
    from kilat.engine.core_client import EngineDeadError

    try:
        ns.func(ns)
    except (ValueError, EngineDeadError) as e:
        print(f"kilat: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
