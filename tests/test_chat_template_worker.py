"""Request-supplied chat templates render in a killable child process: same text as the tokenizer, bounded in
time, memory and output size; and chat_template_kwargs cannot override the renderer's own arguments."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kilat.engine.input_processor import InputProcessor
from kilat.engine.tokenizer import get_tokenizer
from kilat.entrypoints.openai.chat_template_worker import ChatTemplateWorker, RendererUnavailable
from tests.server_utils import pid_alive
from tests.waiting import PATIENCE_S

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                 "{{ greeting }}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    return InputProcessor(get_tokenizer(), vocab_size=49152, max_model_len=2048, eos_token_id=2)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def render_once(processor: InputProcessor, call: dict[str, Any]) -> str:
    """Render ``call`` in a new worker, then close it."""
    worker = ChatTemplateWorker(processor.tokenizer, processor.max_prompt_chars)
    try:
        return await worker.render(call)
    finally:
        await worker.close()


def test_a_model_without_a_chat_template_needs_one_given() -> None:
    """A base model's tokenizer has no template (Gemma 3 270M's GGUF): chat says a template must be given (the
    server answers 400 naming ``chat_template``, as test_gemma3_270m shows), and renders with one that is."""
    tokenizer = get_tokenizer()
    tokenizer.chat_template = None
    bare = InputProcessor(tokenizer, vocab_size=49152, max_model_len=2048, eos_token_id=2)
    with pytest.raises(ValueError, match=r"^chat_template: this model has no chat template .* must give one in "
                                         r"chat_template .* or use the completions API"):
        bare.apply_chat_template(MESSAGES[:2])
    assert bare.apply_chat_template(MESSAGES[:2], chat_template=TOOL_TEMPLATE) == \
        "<system>Be brief.<user>Hi<assistant>"


@pytest.mark.parametrize("template, generation, kwargs", [
    (None, False, {}),  # the model's own template, continuing the final message
    (TOOL_TEMPLATE, True, {"greeting": "!"}),
])
def test_renders_as_the_tokenizer(processor: InputProcessor, template: str | None, generation: bool,
                                  kwargs: dict[str, Any]) -> None:
    call = processor.chat_template_call(MESSAGES, generation, not generation, template, TOOLS, kwargs)

    expected = processor.apply_chat_template(MESSAGES, generation, not generation, template, TOOLS, kwargs)
    assert run(render_once(processor, call)) == expected
    assert expected.endswith("<|im_start|>assistant\nHello" if template is None else
                             "<assistant>Hello[get_weather]!<assistant>")


def test_slow_template_is_killed_and_the_worker_restarts(processor: InputProcessor) -> None:
    async def scenario() -> None:
        worker = ChatTemplateWorker(processor.tokenizer, processor.max_prompt_chars, timeout_s=1.0)
        try:
            good = processor.chat_template_call(MESSAGES[:2], True, False, TOOL_TEMPLATE)
            assert await worker.render(good) == "<system>Be brief.<user>Hi<assistant>"
            first = worker.pid
            assert first is not None
            start = time.monotonic()
            with pytest.raises(ValueError, match=r"^chat_template took longer than 1 s"):
                await worker.render(processor.chat_template_call(MESSAGES[:2], True, False, NESTED_LOOPS))
            assert time.monotonic() - start < 10
            for _ in range(int(PATIENCE_S / 0.05)):  # the killed renderer exits
                if worker.pid is None and not pid_alive(first):
                    break
                await asyncio.sleep(0.05)
            assert worker.pid is None and not pid_alive(first), f"renderer {first} still runs after {PATIENCE_S:g} s"
            assert await worker.render(good) == "<system>Be brief.<user>Hi<assistant>"
            assert worker.pid not in (None, first)
        finally:
            await worker.close()

    run(scenario())


def test_render_that_waits_longer_than_the_limit_is_refused(processor: InputProcessor) -> None:
    """Renders are serialized: one behind a stuck template (which holds the renderer for its start-up plus
    the limit) is refused as busy instead of queueing for N times the limit."""
    stuck = processor.chat_template_call(MESSAGES, True, False, NESTED_LOOPS, None, None)
    plain = processor.chat_template_call(MESSAGES, True, False, TOOL_TEMPLATE, None, None)

    async def both() -> list[Any]:
        worker = ChatTemplateWorker(processor.tokenizer, processor.max_prompt_chars, timeout_s=1.0)
        try:
            first = asyncio.create_task(worker.render(stuck))
            await asyncio.sleep(0)
            results = await asyncio.gather(first, worker.render(plain), return_exceptions=True)
            results.append(await worker.render(plain))  # the renderer is free again
            return results
        finally:
            await worker.close()

    timed_out, busy, text = run(both())
    assert isinstance(timed_out, ValueError) and "took longer than 1 s" in str(timed_out)
    assert isinstance(busy, RendererUnavailable), busy
    assert str(busy) == ("the chat-template renderer is busy with other requests' templates for more than 1 s; "
                         "retry later")
    assert text == "<system>Be brief.<user>Hi<assistant>Hello<assistant>"


def test_child_that_cannot_start_is_unavailable(processor: InputProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once, reading nothing
    call = processor.chat_template_call(MESSAGES, True, False, TOOL_TEMPLATE, None, None)

    with pytest.raises(RendererUnavailable, match="the chat-template renderer process failed to start"):
        run(render_once(processor, call))


def test_stray_print_in_the_child_does_not_corrupt_replies() -> None:
    """The child's stdout carries the replies: a print (here the "tokenizer" is ``print`` itself) goes to
    stderr instead of desynchronising the stream."""
    async def render_twice() -> list[Any]:
        worker = ChatTemplateWorker(SimpleNamespace(apply_chat_template=print), 100, timeout_s=10.0)
        try:
            return [await asyncio.gather(worker.render({"end": "stray output"}), return_exceptions=True)
                    for _ in range(2)]
        finally:
            await worker.close()

    for (result,) in run(render_twice()):
        assert isinstance(result, ValueError) and str(result) == "chat_template failed: rendered NoneType, not text"


def test_cancelled_render_kills_the_child(processor: InputProcessor) -> None:
    async def scenario() -> None:
        worker = ChatTemplateWorker(processor.tokenizer, processor.max_prompt_chars, timeout_s=60.0)
        try:
            await worker.render(processor.chat_template_call(MESSAGES[:2], True, False, TOOL_TEMPLATE))
            pid = worker.pid
            task = asyncio.create_task(
                worker.render(processor.chat_template_call(MESSAGES[:2], True, False, NESTED_LOOPS)))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            assert pid is not None and not pid_alive(pid)
        finally:
            await worker.close()

    run(scenario())


@pytest.mark.parametrize("template, needle", [
    ("{{ 'x' * 1000 }}", "rendered 1000 characters, more than a prompt can hold (100)"),
    ("{{ 'x' * 3000000000 }}", "out of memory: the limit is 256 MiB"),
    ("{{ raise_exception('no system messages') }}", "chat_template failed: no system messages"),
])
def test_bounded_output_memory_and_errors(processor: InputProcessor, template: str, needle: str) -> None:
    async def scenario() -> None:
        worker = ChatTemplateWorker(processor.tokenizer, max_output_chars=100, memory_limit_bytes=256 << 20)
        try:
            with pytest.raises(ValueError, match="chat_template") as info:
                await worker.render(processor.chat_template_call(MESSAGES[:2], True, False, template))
            assert needle in str(info.value)
            ok = processor.chat_template_call(MESSAGES[:2], True, False, TOOL_TEMPLATE)
            assert await worker.render(ok) == "<system>Be brief.<user>Hi<assistant>"
        finally:
            await worker.close()

    run(scenario())


@pytest.mark.parametrize("key", ["messages", "conversation", "chat_template", "tools", "add_generation_prompt",
                                 "continue_final_message", "tokenize", "return_dict", "documents"])
def test_chat_template_kwargs_cannot_override_renderer_arguments(processor: InputProcessor, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs must not set \['{key}'\]"):
        processor.apply_chat_template(MESSAGES[:2], chat_template_kwargs={key: "x"})


def test_worker_script_imports_neither_kilat_nor_torch() -> None:
    import subprocess
    import sys

    from kilat.entrypoints.openai import chat_template_worker

    code = (f"import runpy, sys; runpy.run_path({chat_template_worker.__file__!r}); "
            "print(sorted(m for m in ('kilat', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}, check=True)
    assert out.stdout.strip() == "[]"
