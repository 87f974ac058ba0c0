"""The ``kilat`` command line: every subcommand parses, and ``generate`` / ``chat`` run end to end."""

from __future__ import annotations

import io

import pytest

from kilat.entrypoints.cli import build_parser, main


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
    assert out.startswith("> ") and out.count("> ") == 2


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
