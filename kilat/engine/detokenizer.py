"""Incremental, UTF-8-safe detokenization of one completion, with stop-string matching and hold-back.

The decoding follows vLLM's ``detokenize_incrementally``: tokens are kept as token strings and only a short
window ``tokens[prefix_offset:]`` is converted per step. The text of ``tokens[prefix_offset:read_offset]``
was already emitted; the window's text beyond it is new. When the window's text ends in U+FFFD the last
token ends inside a multi-byte UTF-8 character, so nothing is emitted and the window grows until the
character is complete. Each step therefore costs O(window), not O(output).

Stop strings follow the OpenAI API / vLLM: generation ends at the first stop string found in the text,
which is cut just before it (or just after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5
"""Prompt tokens decoded ahead of the output so that its first token gets its leading space right
(vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``)."""


class IncrementalDetokenizer:
    """Text of one completion, built token by token.

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``, ``convert_tokens_to_string``,
            ``get_added_vocab``, ``added_tokens_decoder``, ``all_special_ids``).
        params: the request's sampling parameters (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``spaces_between_special_tokens``).
        prompt_token_ids: the prompt; its last tokens give the decoding context of the first output token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
                 prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.params = params
        self._skipped_ids: set[int] = set()
        if params.skip_special_tokens:
            self._skipped_ids = set(tokenizer.all_special_ids) | {
                i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self._added_tokens = set(tokenizer.get_added_vocab())
        # Fast tokenizers' decode joins added tokens to their neighbours without spaces whatever
        # spaces_between_special_tokens says (Hugging Face, and vLLM's fast path); slow ones put spaces.
        spaced = params.spaces_between_special_tokens and not getattr(tokenizer, "is_fast", False)
        self._separator = " " if spaced else ""
        self._tokens = self._to_tokens(prompt_token_ids[-(_PROMPT_CONTEXT + 2):])
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)
        self._text = ""
        self._num_generated = 0

    @property
    def output_text(self) -> str:
        """The completion's text so far (cut at a matched stop string)."""
        return self._text

    @property
    def num_tokens(self) -> int:
        """Generated tokens added so far (a matched stop string leaves out the tokens after it)."""
        return self._num_generated

    def add_tokens(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens to the text and look for stop strings in the new text.

        Several tokens at once (speculative decoding) are matched one by one, so that the tokens after the
        one completing a stop string are not added, as if they had arrived one at a time: :attr:`num_tokens`
        tells how many were.

        Args:
            new_token_ids: the tokens generated since the last call.
            stop_terminated: the core finished the request on the last token (EOS or a stop token id); that
                token's text is left out unless ``include_stop_str_in_output``.

        Returns:
            The matched stop string (the text is then cut at it), or ``None``. Stop strings are not
            looked for until ``min_tokens`` tokens were generated (vLLM's rule).
        """
        if not self.params.stop or len(new_token_ids) <= 1:
            return self._add(new_token_ids, stop_terminated)
        for i, token in enumerate(new_token_ids):
            stop = self._add([token], stop_terminated and i == len(new_token_ids) - 1)
            if stop is not None:
                return stop
        return None

    def _add(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """:meth:`add_tokens` for tokens matched together."""
        self._num_generated += len(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        self._tokens.extend(self._to_tokens(new_token_ids))
        prefix_text = self._to_text(self._tokens[self._prefix_offset:self._read_offset])
        window_text = self._to_text(self._tokens[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return None
        num_checked = len(self._text)
        self._text += window_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        if self._num_generated < self.params.min_tokens:
            return None
        return self._match_stop(num_checked)

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        """Token strings of the ids, without skipped special tokens and ids unknown to the tokenizer."""
        tokens = self.tokenizer.convert_ids_to_tokens(
            [t for t in token_ids if t not in self._skipped_ids])
        return [token for token in tokens if token is not None]

    def _to_text(self, tokens: list[str]) -> str:
        """Text of token strings, as the tokenizer's ``decode`` gives it: added tokens are kept verbatim and,
        for a slow tokenizer with ``spaces_between_special_tokens``, joined to their neighbours with a space."""
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_tokens:
                if run:
                    pieces.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(run))
        return self._separator.join(pieces)

    def _match_stop(self, num_checked: int) -> str | None:
        """Find the stop string that completes first in the text after ``num_checked`` chars; cut there."""
        best: tuple[int, int, str] | None = None
        for stop in self.params.stop:
            start = self._text.find(stop, max(num_checked - len(stop) + 1, 0))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self._text = self._text[:end if self.params.include_stop_str_in_output else start]
        return stop


class TextDelta:
    """The part of a growing completion text that is safe to stream (OpenAI-style ``delta``).

    Unless the text is final, a trailing piece that could still grow into a stop string (the longest suffix
    that is a proper prefix of a stop string) is held back, so that no character of a stop string is ever
    sent. Since the detokenizer only cuts the text at a stop string, the text already sent stays a prefix of
    the final text, and all deltas concatenated equal it once a call with ``finished=True`` was made.

    Args:
        stop: the request's stop strings.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.num_sent = 0

    def next(self, text: str, finished: bool) -> str:
        """The text after what earlier calls returned, less a possible partial stop string unless
        ``finished``."""
        end = len(text)
        if not finished:
            end -= max((_partial_stop_len(text, stop) for stop in self.stop), default=0)
        if end <= self.num_sent:
            return ""
        delta = text[self.num_sent:end]
        self.num_sent = end
        return delta


def _partial_stop_len(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop`` (0 if none).

    Only positions holding ``stop[0]`` can start such a suffix, so the scan jumps between them.
    """
    start = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
    while start != -1:
        if stop.startswith(text[start:]):
            return len(text) - start
        start = text.find(stop[0], start + 1)
    return 0
