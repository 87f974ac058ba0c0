"""The ``kilat`` command line: ``kilat serve`` (OpenAI-compatible server), ``kilat proxy`` (one endpoint in front
of disaggregated prefill and decode servers), ``kilat bench`` (benchmarks), ``kilat plan``, ``kilat train-draft``
(EAGLE-3 heads), ``kilat generate`` and an interactive, streaming ``kilat chat``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import signal
import sys
import typing
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any, NoReturn

import kilat
from kilat.child_process import exit_now
from kilat.config import (
    CacheConfig,
    EngineArgs,
    ExecutionConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from kilat.entrypoints.openai.reasoning import REASONING_PARSERS
from kilat.entrypoints.openai.server_config import ServerConfig
from kilat.sampling_params import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, unless the help states it itself (``default:``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default:" in text else super()._get_help_string(action)


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", re.IGNORECASE)
SIZE_FORMAT = ("bytes, or a number with a unit: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB and K/M/G/T "
               "powers of 1024 (4GiB, 512MB, 1.5G)")


def parse_size(text: str, name: str = "size") -> int:
    """A byte count from ``"4GiB"``, ``"512MB"``, ``"4G"`` or ``"1048576"`` (case-insensitive).

    KB, MB, GB and TB are SI units (10**3, 10**6, ...); KiB, MiB, GiB, TiB and the bare K, M, G, T (as in
    ``docker --memory`` or Java's ``-Xmx``) are binary (2**10, 2**20, ...). A fraction is allowed when the
    result is a whole number of bytes (``1.5KiB`` = 1536).

    Raises:
        ValueError: not a size, or not a whole number of bytes; the message names ``name``.
    """
    match = _SIZE.fullmatch(text)
    unit = _SIZE_UNITS.get(match[2].lower()) if match else None
    try:
        value = Decimal(match[1]) * unit if unit is not None else None
    except InvalidOperation:
        value = None
    if value is None or value != value.to_integral_value():
        raise ValueError(f"invalid {name} {text!r}: expected {SIZE_FORMAT}")
    return int(value)


def _size_arg(text: str) -> int:
    """``parse_size`` for argparse, which names the flag in its message."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_size_arg.__name__ = "size"


def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's text in the ``Attributes:`` section of a (Google-style) class docstring, joined into one
    line with reST markup (````x````, ``:class:`X```) reduced to plain text."""
    docs: dict[str, str] = {}
    name = None
    section = False
    for line in (inspect.getdoc(cls) or "").splitlines():
        if not line.startswith(" "):
            section = line.strip() == "Attributes:"
            continue
        if section and (entry := re.match(r" {4}(\w+): (.*)", line)):
            name = entry[1]
            docs[name] = entry[2]
        elif section and name and line.startswith(" " * 8):
            docs[name] += " " + line.strip()
    return {k: re.sub(r":\w+:`~?([^`]*)`", r"\1", v).replace("``", "") for k, v in docs.items()}


def engine_arg_help() -> dict[str, str]:
    """The help of each :class:`EngineArgs` flag, from the docs of the config class that owns the field (or of
    ``EngineArgs`` itself for the engine's own fields): one place for each text."""
    docs: dict[str, str] = {}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig, ParallelConfig, EngineArgs):
        docs.update(attribute_docs(cls))
    docs["speculative_config"] += f" Keys: {', '.join(f.name for f in dataclasses.fields(SpeculativeConfig))}."
    docs["structured_outputs_config"] += " Keys (defaults): " + ", ".join(
        f"{f.name} ({f.default})" for f in dataclasses.fields(StructuredOutputsConfig)) + "."
    docs["kv_transfer_config"] += f" Keys: {', '.join(f.name for f in dataclasses.fields(KVTransferConfig))}."
    for f in dataclasses.fields(EngineArgs):
        if f.metadata.get("size") and f.name in docs:
            docs[f.name] += f" Accepts {SIZE_FORMAT}."
    return docs


def _arg_type(f: dataclasses.Field, hint: Any) -> Callable[[str], Any]:
    """The argparse type of an :class:`EngineArgs` field: a size, int, float or str (``X | None`` as ``X``)."""
    if f.metadata.get("size"):
        return _size_arg
    kinds = typing.get_args(hint) or (hint,)
    return next((kind for kind in (int, float) if kind in kinds), str)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`EngineArgs` field (``model`` is positional, optional), each with the help
    of :func:`engine_arg_help`."""
    docs = engine_arg_help()
    hints = typing.get_type_hints(EngineArgs)
    parser.add_argument("model", nargs="?", default=None, help=docs["model"])
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        text = docs.get(f.name, "").replace("%", "%%") or None
        if hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            parser.add_argument(flag, type=_arg_type(f, hints[f.name]), default=f.default, help=text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Collect the :class:`EngineArgs` fields from parsed arguments."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    """``--max-tokens``, ``--temperature``, ``--top-p`` and ``--top-k``, documented by :class:`SamplingParams`."""
    docs = attribute_docs(SamplingParams)
    for name, kind, default in (("max_tokens", int, 256), ("temperature", float, 0.0), ("top_p", float, 1.0),
                                ("top_k", int, 0)):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=docs[name])


def _params(ns: argparse.Namespace) -> SamplingParams:
    """Sampling parameters from the flags; ``--seed`` (an engine argument) also seeds each request."""
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.seed)


def _stream(engine: Any, request_id: str) -> str:
    """Step the engine, printing the request's new text as it arrives; return the full text.

    Ctrl-C (SIGINT) stops the reply between two engine steps: the request is aborted and the text so far
    returned, followed by `` [stopped]`` on the terminal.
    """
    printed = ""
    stop = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        while engine.has_unfinished_requests() and not stop:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                sys.stdout.write(text[len(printed):] if text.startswith(printed) else "\n" + text)
                sys.stdout.flush()
                printed = text
        if stop:
            engine.abort_request([request_id])
            sys.stdout.write(" [stopped]")
    finally:
        signal.signal(signal.SIGINT, previous)
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


CHAT_EXIT_WORDS = ("/exit", "/quit", "exit", "quit")
"""Lines that end ``kilat chat`` (case-insensitive) instead of going to the model."""
CHAT_HINT = "Type /exit or press Ctrl-D to leave (an empty line also ends); Ctrl-C stops a reply."


def fit_history(engine: Any, messages: list[dict[str, str]], max_tokens: int) -> str:
    """Render ``messages`` with the chat template, first dropping the oldest turns (a system message stays)
    until the prompt plus ``max_tokens`` fits ``max_model_len``; ``messages`` is trimmed in place.

    The last message is always kept: when it alone does not fit, the prompt is returned as is and the engine
    refuses it with a ``ValueError``.
    """
    processor = engine.input_processor
    first = 1 if messages[0]["role"] == "system" else 0
    while True:
        prompt = processor.apply_chat_template(messages)
        if len(messages) - first <= 1:
            return prompt
        if len(engine.tokenizer.encode(prompt, add_special_tokens=False)) + max_tokens <= processor.max_model_len:
            return prompt
        del messages[first:first + 2]  # the oldest user turn and its reply
        print(f"(dropped the oldest turn to fit max_model_len = {processor.max_model_len})", file=sys.stderr)


def cmd_chat(ns: argparse.Namespace) -> None:
    """Interactive chat that streams replies; ``/exit``, ``/quit``, an empty line, EOF (Ctrl-D) or Ctrl-C at
    the prompt end it, and Ctrl-C during a reply stops that reply. The oldest turns are dropped when the
    conversation would outgrow ``max_model_len`` (see :func:`fit_history`)."""
    from kilat.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    engine = llm.engine
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print(CHAT_HINT)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if not line.strip() or line.strip().lower() in CHAT_EXIT_WORDS:
            break
        messages.append({"role": "user", "content": line})
        prompt = fit_history(engine, messages, ns.max_tokens)
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
    from kilat.entrypoints.openai.api_server import run_server

    config = ServerConfig(host=ns.host, port=ns.port, served_model_name=ns.served_model_name or [],
                          api_key=ns.api_key, max_request_body_bytes=ns.max_request_body_bytes,
                          trust_request_chat_template=ns.trust_request_chat_template,
                          tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                          reasoning_parser_config=ns.reasoning_parser_config, uvicorn_log_level=ns.uvicorn_log_level,
                          disable_uvicorn_access_log=ns.disable_uvicorn_access_log,
                          max_engine_core_restarts=ns.max_engine_core_restarts)
    run_server(engine_args_from(ns), config)


def _server_args(parser: argparse.ArgumentParser) -> None:
    """``kilat serve``'s server flags; their defaults are :class:`ServerConfig`'s."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    parser.add_argument("--host", default=defaults["host"],
                        help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=defaults["port"], help="TCP port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model names clients may use (default: the model path, or SmolLM2-135M-Instruct)")
    parser.add_argument("--api-key", default=os.environ.get("KILAT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                             "(default: $KILAT_API_KEY)")
    parser.add_argument("--max-request-body-bytes", type=_size_arg, default=defaults["max_request_body_bytes"],
                        help=f"larger request bodies get HTTP 413; {SIZE_FORMAT}")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat_template in chat requests (it runs on the server)")
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                        help="parse tool calls in tool_choice='auto' outputs (hermes: <tool_call>{...}</tool_call>)")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="split chat outputs into reasoning (message.reasoning_content and .reasoning) and "
                             "answer (content): deepseek_r1 and qwen3 read <think>...</think>, tags the "
                             "--reasoning-parser-config strings; an output with no end tag is all reasoning")
    parser.add_argument("--reasoning-parser-config", default=None, metavar="JSON",
                        help='the reasoning tags, e.g. \'{"start": "<think>", "end": "</think>"}\' (needed by tags)')
    parser.add_argument("--uvicorn-log-level", default=defaults["uvicorn_log_level"],
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server (uvicorn)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log one line per HTTP request")
    parser.add_argument("--max-engine-core-restarts", type=int, default=defaults["max_engine_core_restarts"],
                        metavar="N",
                        help="restart a dead engine core up to N times in a row (backoff 1, 2, 4 ... s; a core that "
                             "served 60 s ends the row), then exit non-zero; 0: exit at once, for a supervisor "
                             "such as systemd or Kubernetes to restart the server (as vLLM does)")


def cmd_proxy(ns: argparse.Namespace) -> None:
    """Serve the disaggregated prefill/decode proxy until SIGINT or SIGTERM."""
    from kilat.entrypoints.disagg_proxy import run_proxy

    run_proxy(ns.prefill, ns.decode, host=ns.host, port=ns.port, timeout=ns.timeout, api_key=ns.api_key,
              log_level=ns.uvicorn_log_level)


def _proxy_args(parser: argparse.ArgumentParser) -> None:
    """``kilat proxy``'s flags."""
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URL of each prefill instance (kilat serve), used in turn, e.g. "
                             "http://127.0.0.1:8100; a trailing / or /v1 is ignored (default: none, required)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URL of each decode instance, used in turn; the first also answers GET "
                             "/v1/models (default: none, required)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for the whole prefill call, and for the decode call to connect and to send "
                             "each piece of its answer (a non-streamed answer is one piece); 504 when exceeded")
    parser.add_argument("--api-key", default=os.environ.get("KILAT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (forwarded upstream) "
                             "(default: $KILAT_API_KEY)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server (uvicorn)")


def build_parser() -> argparse.ArgumentParser:
    """The ``kilat`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="kilat", description="Kilat LLM inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kilat {kilat.__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to run")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API (HTTP)", formatter_class=HelpFormatter)
    add_engine_args(serve)
    _server_args(serve)
    serve.set_defaults(func=cmd_serve)
    proxy = sub.add_parser("proxy", help="one OpenAI endpoint in front of disaggregated prefill and decode servers",
                           description="Send each completion first to a prefill instance (max_tokens 1, "
                                       "kv_transfer_params do_remote_decode), then to a decode instance with the "
                                       "kv_transfer_params the prefill answered; relay the decode's answer.",
                           formatter_class=HelpFormatter)
    _proxy_args(proxy)
    proxy.set_defaults(func=cmd_proxy)
    gen = sub.add_parser("generate", help="generate completions offline", formatter_class=HelpFormatter)
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; default: read stdin)")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with streaming replies", formatter_class=HelpFormatter)
    add_engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt (default: none, the template's own)")
    chat.set_defaults(func=cmd_chat)
    from kilat.bench.cli import add_bench_parser
    from kilat.plan.cli import add_plan_parser
    from kilat.train_draft.cli import add_train_draft_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    add_train_draft_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """The ``kilat`` command's work (``argv`` default: the command line); errors exit with status 2, Ctrl-C with 130.
    Callable in-process; :func:`run` is the command's process."""
    ns = build_parser().parse_args(argv)
    from kilat.engine.core_client import EngineDeadError

    try:
        ns.func(ns)
    except (ValueError, EngineDeadError) as e:
        print(f"kilat: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def run() -> NoReturn:
    """Entry point of the ``kilat`` command's process: :func:`main`, then the process ends with its status (0, or a
    ``SystemExit``'s, as the interpreter would give it) without the interpreter's teardown
    (:func:`~kilat.child_process.exit_now`; about a second of CPU at every exit)."""
    try:
        main()
    except SystemExit as e:  # kilat's errors (2), Ctrl-C (130), kilat serve's SIGTERM (143), argparse's (0, 2)
        if e.code is not None and not isinstance(e.code, int):  # as the interpreter prints it
            print(e.code, file=sys.stderr)
        exit_now(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    exit_now(0)


if __name__ == "__main__":
    run()
