"""The ``kilat`` command line: every subcommand parses, and ``generate`` / ``chat`` run end to end."""

from __future__ import annotations

import argparse
import dataclasses
import io
import signal
import subprocess
import sys

import pytest

import kilat
from kilat.config import CacheConfig, EngineArgs, ExecutionConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kilat.entrypoints.cli import CHAT_HINT, HelpFormatter, _stream, build_parser, engine_arg_help, main, parse_size


def _parsers(parser: argparse.ArgumentParser, path: str = "kilat"):
    """Every parser of the ``kilat`` command, sub-commands included, with its command path."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_flag_has_help_and_shows_its_default():
    """Each argument of every sub-command has a help line, and every flag with a value shows its default."""
    missing, no_default = [], []
    parsers = list(_parsers(build_parser()))
    assert {"kilat serve", "kilat generate", "kilat chat", "kilat bench serve", "kilat bench throughput",
            "kilat bench latency"} <= {path for path, _ in parsers}
    for path, parser in parsers:
        assert issubclass(parser.formatter_class, HelpFormatter), path
        formatter = parser.formatter_class(prog=path)
        for action in parser._actions:
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing.append(name)
            elif action.option_strings and action.nargs != 0 and "default" not in formatter._get_help_string(action):
                no_default.append(name)
    assert missing == [] and no_default == []


def test_engine_flags_take_help_and_defaults_from_the_config_classes():
    docs = engine_arg_help()
    assert set(docs) >= {f.name for f in dataclasses.fields(EngineArgs)}
    assert docs["block_size"] == "token slots per KV block."
    assert docs["max_num_seqs"] == "most requests running at once."
    assert docs["distributed_executor_backend"].startswith('"uni" (one worker in the engine core')
    assert "ngram" in docs["speculative_config"] and "num_speculative_tokens" in docs["speculative_config"]
    own = {f.name: f.default for cls in (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig, ParallelConfig)
           for f in dataclasses.fields(cls)}
    shared = [f for f in dataclasses.fields(EngineArgs) if f.name in own]
    assert {f.name for f in shared} == set(own) and all(f.default == own[f.name] for f in shared)


@pytest.mark.parametrize(("text", "size"), [
    ("4GiB", 4 << 30), ("4gib", 4 << 30), ("4G", 4 << 30), ("4 g", 4 << 30), ("512MB", 512_000_000),
    ("512MiB", 512 << 20), ("16M", 16 << 20), ("1KB", 1000), ("1k", 1024), ("1.5KiB", 1536), ("2TB", 2 * 10**12),
    ("1048576", 1048576), ("100B", 100), (" 7 ", 7)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "4XB", "-1", "1e9", "1.5", "0.1KiB", "4 GiB extra", "nan"])
def test_parse_size_refuses_garbage_naming_the_field(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size(text, "kv_cache_memory")


def test_sizes_and_optional_ints_parse_as_flags(capsys):
    ns = build_parser().parse_args(["serve", "--kv-cache-memory", "4GiB", "--max-request-body-bytes", "512MB",
                                    "--max-model-len", "4096", "--num-threads", "2", "--num-gpu-blocks-override",
                                    "64", "--gpu-memory-utilization", "0.5"])
    assert (ns.kv_cache_memory, ns.max_request_body_bytes) == (4 << 30, 512_000_000)
    assert (ns.max_model_len, ns.num_threads, ns.num_gpu_blocks_override, ns.gpu_memory_utilization) == (
        4096, 2, 64, 0.5)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.kv_cache_memory, defaults.max_request_body_bytes, defaults.max_model_len) == (None, 16 << 20,
                                                                                                     None)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--kv-cache-memory", "4XB"])
    assert e.value.code == 2 and "argument --kv-cache-memory: invalid size '4XB'" in capsys.readouterr().err


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"kilat {kilat.__version__}\n"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["chat"],
                                  ["chat", "--no-enable-prefix-caching", "--seed", "3", "--max-num-seqs", "4"]])
def test_parser_accepts_every_subcommand(argv):
    ns = build_parser().parse_args(argv)
    assert ns.command == argv[0] and ns.model is None


def test_generate_prints_greedy_completion(tiny_llama_dir, capsys):
    args = [tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(16 << 20),
            "--max-tokens", "5"]
    main(["generate", *args, "--prompt", "Hello"])
    first = capsys.readouterr().out
    main(["generate", *args, "--prompt", "Hello"])
    assert capsys.readouterr().out == first and first.strip()


def test_chat_streams_a_reply_and_ends_on_empty_line(tiny_llama_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n\n"))
    main(["chat", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory",
          str(16 << 20), "--max-tokens", "6"])
    out = capsys.readouterr().out
    assert out.startswith(CHAT_HINT + "\n> ") and out.count("> ") == 2


@pytest.mark.parametrize("word", ["/exit", "/QUIT", "quit", " exit "])
def test_chat_leaves_on_exit_words(tiny_llama_dir, capsys, monkeypatch, word):
    """The exit word ends the chat: it is not sent to the model, and the lines after it are never read."""
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Hi there\n{word}\nnever read\n"))
    main(["chat", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
          "--max-tokens", "3"])
    assert capsys.readouterr().out.count("> ") == 2


def test_chat_drops_oldest_turns_to_fit_max_model_len(tiny_llama_dir, capsys, monkeypatch):
    """Four ~45-token turns in a 128-token context: the oldest turns go, and no turn is refused."""
    line = " ".join(["lightning over the sea"] * 10)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{line}\n" * 4))
    main(["chat", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "16MiB",
          "--max-tokens", "8", "--system", "Be brief."])
    captured = capsys.readouterr()
    assert captured.out.count("> ") == 5 and "error" not in captured.out
    assert "dropped the oldest turn to fit max_model_len = 128" in captured.err


class _EndlessEngine:
    """Streams one more "x" per step until aborted; the third step is interrupted by SIGINT (Ctrl-C)."""

    def __init__(self):
        self.steps = 0
        self.aborted: list[str] = []

    def has_unfinished_requests(self):
        return not self.aborted

    def step(self):
        self.steps += 1
        if self.steps == 3:
            signal.raise_signal(signal.SIGINT)
        output = type("Completion", (), {"text": "x" * self.steps})
        return [type("Output", (), {"request_id": "r", "outputs": [output]})]

    def abort_request(self, ids):
        self.aborted += ids


def test_ctrl_c_stops_the_reply_not_the_chat(capsys):
    engine, before = _EndlessEngine(), signal.getsignal(signal.SIGINT)
    assert _stream(engine, "r") == "xxx"
    assert engine.aborted == ["r"] and capsys.readouterr().out == "xxx [stopped]\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_bad_engine_flag_exits_with_message(tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", tiny_llama_dir, "--block-size", "3", "--prompt", "x"])
    assert e.value.code == 2 and "block_size" in capsys.readouterr().err


def test_speculative_config_flag_gives_the_same_output(tiny_llama_dir, capsys):
    args = [tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(16 << 20),
            "--max-tokens", "12", "--prompt", "Hello Hello Hello"]
    main(["generate", *args])
    plain = capsys.readouterr().out
    main(["generate", *args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert capsys.readouterr().out == plain and plain.strip()
    with pytest.raises(SystemExit) as e:
        main(["generate", *args, "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'])
    assert e.value.code == 2 and "speculative_config.method" in capsys.readouterr().err


EXIT_SCRIPT = """
import atexit, sys, threading, time
from kilat.child_process import exit_now
marker = sys.argv[1]
atexit.register(lambda: open(marker, "a").write("atexit "))
def late():
    time.sleep(0.3)
    open(marker, "a").write("thread ")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(2).submit(lambda: 1).result()  # an idle pool left open: threading's shutdown wakes its workers
sys.stdout.write("buffered")  # no newline, no flush: exit_now flushes it
exit_now(3)
"""


def test_exit_now_keeps_what_the_interpreter_exit_does(tmp_path):
    """``exit_now``: the status, a non-daemon thread joined first, an idle thread pool's workers ended (no hang),
    atexit handlers run, stdout flushed."""
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(marker)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered" and marker.read_text() == "thread atexit "


@pytest.mark.parametrize(("args", "code", "stream", "needle"), [
    (["--version"], 0, "stdout", f"kilat {kilat.__version__}"),
    (["serve", "--port", "70000"], 2, "stderr", "port must be in [0, 65535], got 70000"),
    (["no-such-command"], 2, "stderr", "invalid choice"),
])
def test_the_command_process_exits_with_mains_status(args, code, stream, needle):
    """``kilat`` (``run``) ends with the status ``main`` gives, its output flushed."""
    proc = subprocess.run([sys.executable, "-m", "kilat.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code and needle in getattr(proc, stream), (proc.stdout, proc.stderr)
