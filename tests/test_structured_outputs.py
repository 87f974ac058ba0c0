"""Structured outputs on the embedded SmolLM2 (float32, greedy): JSON schemas, regex, choice, EBNF grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from kilat import LLM, SamplingParams
from kilat.sampling_params import StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", PERSON),
    ("a city with its country", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                                  "country": {"type": "string", "maxLength": 24}},
                                 "required": ["city", "country"]}),
    ("a boolean answer to: is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                                               "required": ["answer"]}),
    ("a traffic light color", {"type": "object", "properties": {"color": {"enum": ["red", "yellow", "green"]}},
                               "required": ["color"]}),
    ("three prime numbers", {"type": "object", "properties": {"primes": {
        "type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 100}, "minItems": 3,
        "maxItems": 3}}, "required": ["primes"]}),
    ("a temperature in Celsius", {"type": "object", "properties": {"celsius": {
        "type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"]}),
    ("a US zip code", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["zip"]}),
    ("an ISO date", {"type": "object", "properties": {"date": {
        "type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}, "required": ["date"]}),
    ("a book with its author", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 15},
                                                    "last": {"type": "string", "maxLength": 15}},
                   "required": ["first", "last"]}}, "required": ["title", "author"]}),
    ("a team of two people", {"type": "object", "$defs": {"person": PERSON}, "properties": {
        "members": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 2, "maxItems": 2}},
        "required": ["members"]}),
    ("a point in 2D", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                        "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                       "required": ["x", "y"], "additionalProperties": False}),
    ("a list of up to four fruits", {"type": "object", "properties": {"fruits": {
        "type": "array", "items": {"enum": ["apple", "banana", "cherry", "mango"]}, "minItems": 1,
        "maxItems": 4}}, "required": ["fruits"]}),
    ("a product with a price", {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 20}, "price": {"type": "number", "exclusiveMinimum": 0,
                                                                   "maximum": 1000},
        "currency": {"const": "USD"}}, "required": ["product", "price", "currency"]}),
    ("an RGB color", {"type": "object", "properties": {"rgb": {
        "type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 255}] * 3, "minItems": 3,
        "maxItems": 3, "items": False}}, "required": ["rgb"]}),
    ("a username", {"type": "object", "properties": {"username": {
        "type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}}, "required": ["username"]}),
    ("a rating from 1 to 5 with a comment", {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "comment": {"type": "string", "maxLength": 40}}, "required": ["stars", "comment"]}),
    ("a nullable middle name", {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 12}, "middle": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["first", "middle"]}),
    ("a shape, either a circle or a square", {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["radius"], "additionalProperties": False},
        {"type": "object", "properties": {"side": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["side"], "additionalProperties": False}]}}, "required": ["shape"]}),
    ("an address", {"type": "object", "$defs": {"street": {"type": "string", "maxLength": 25}}, "properties": {
        "street": {"$ref": "#/$defs/street"}, "number": {"type": "integer", "minimum": 1, "maximum": 999},
        "city": {"type": "string", "maxLength": 20}}, "required": ["street", "number", "city"]}),
    ("a matrix of 2 by 2 small integers", {"type": "object", "properties": {"matrix": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                                      "maximum": 9}}}}, "required": ["matrix"]}),
]
ARITHMETIC = 'root ::= number op number\nop ::= "+" | "-" | "*"\nnumber ::= [1-9] | [1-9] [0-9]'


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(dtype="float32", max_model_len=1024) as llm:
        yield llm  # its compile workers are stopped at the end of the module


def chat(llm: LLM, prompts: list[str], params: list[SamplingParams] | SamplingParams) -> list:
    return [o.outputs[0] for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                                           use_tqdm=False)]


def test_twenty_json_schemas_parse_and_validate(llm: LLM) -> None:
    assert len(SCHEMAS) == 20
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in SCHEMAS]
    outputs = chat(llm, [f"Reply in JSON with {what}." for what, _ in SCHEMAS], params)
    for (what, schema), out in zip(SCHEMAS, outputs, strict=True):
        assert out.finish_reason == "stop", (what, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_schemas_differing_in_property_order_keep_their_own_order(llm: LLM) -> None:
    def schema(names: list[str]) -> dict:
        return {"type": "object", "properties": {n: {"type": "integer", "minimum": 0, "maximum": 9} for n in names},
                "required": names, "additionalProperties": False}

    orders = [["width", "height"], ["height", "width"]]
    for order in orders:  # one after the other: the second would be served the first's cached grammar before
        out = chat(llm, ["Reply in JSON with a width and a height."],
                   SamplingParams(temperature=0, max_tokens=30,
                                  structured_outputs=StructuredOutputsParams(json=schema(order))))[0]
        assert out.finish_reason == "stop" and list(json.loads(out.text)) == order, out.text


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    specs = [StructuredOutputsParams(regex=r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
             StructuredOutputsParams(regex=r"[A-Z][a-z]+ (is|was) [a-z]+\."),
             StructuredOutputsParams(choice=["Positive", "Negative", "Neutral"]),
             StructuredOutputsParams(grammar=ARITHMETIC),
             StructuredOutputsParams(json_object=True)]
    prompts = ["When was the Moon landing? Give the date.", "Describe Jakarta in one sentence.",
               "Sentiment of 'I love this!'?", "What is 2 plus 3? Write it as an expression.",
               'Give a JSON object with one key "animal".']
    outs = chat(llm, prompts, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=s) for s in specs])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert re.fullmatch(specs[0].regex, outs[0].text) and re.fullmatch(specs[1].regex, outs[1].text)
    assert outs[2].text in specs[2].choice
    assert re.fullmatch(r"[1-9][0-9]?[-+*][1-9][0-9]?", outs[3].text)
    assert isinstance(json.loads(outs[4].text), dict)


def test_sampled_choices_stay_in_the_set(llm: LLM) -> None:
    choices = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(n=8, temperature=1.5, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    (output,) = llm.generate(["Pick a Greek letter:"], params, use_tqdm=False)
    assert all(c.text in choices and c.finish_reason == "stop" for c in output.outputs)


def test_unconstrained_rows_are_unchanged_in_a_mixed_batch(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = chat(llm, ["Name three colors."], plain)[0]
    mixed = chat(llm, ["Name three colors.", "Reply in JSON with a person."],
                 [plain, SamplingParams(temperature=0, max_tokens=60,
                                        structured_outputs=StructuredOutputsParams(json=PERSON))])
    assert mixed[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), PERSON)


def test_cut_by_max_tokens_reports_length(llm: LLM) -> None:
    out = chat(llm, ["Reply in JSON with a person."],
               SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize("spec,match", [
    ({"json": "{not json"}, "structured_outputs.json: invalid JSON schema"),
    ({"json": {"type": "objekt"}}, "structured_outputs.json: invalid JSON schema: Unsupported type"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json: invalid JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex: invalid regex"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar: invalid grammar"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
])
def test_invalid_specs_are_refused_and_the_engine_carries_on(llm: LLM, spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_structured_outputs_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    assert StructuredOutputsParams(json={"a": 2, "b": 1}).key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key != StructuredOutputsParams(json={"a": 2, "b": 1}).key
    with pytest.raises(ValueError, match="json_object must be a boolean"):
        StructuredOutputsParams(json_object="yes")


def test_allowed_argmax_equals_argmax_of_masked_logits() -> None:
    import torch
    import xgrammar as xgr

    from kilat.structured_outputs.manager import TokenBitmask, allowed_argmax, apply_bitmask_

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    logits[5, :] = float("-inf")
    logits[5, 7] = 0.0  # only token 7 is finite; the grammar forbids it below
    bitmask = xgr.allocate_token_bitmask(6, 1000)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int32))
    bitmask[1] = 0
    bitmask[1, 3] = 1 << 5  # row 1 allows token 3 * 32 + 5 = 101 only: far down its ranking
    bitmask[5, 0] &= ~(1 << 7)
    mask = TokenBitmask(bitmask, [0, 1, 2, 3, 5])
    picks = allowed_argmax(logits, mask, mask.rows)
    masked = logits.clone()
    apply_bitmask_(masked, mask, mask.rows)
    expected = masked.argmax(dim=-1).tolist()
    assert 1 not in picks or picks[1] == 101
    assert 5 not in picks  # nothing allowed is finite: left to the masked path
    assert all(picks[r] == expected[r] for r in picks) and {0, 2, 3} <= set(picks)


def test_bitmask_rows_follow_drafts_and_leave_the_matcher_as_it_was(llm: LLM) -> None:
    import time

    from kilat.structured_outputs.manager import TokenBitmask, build_bitmask

    tokenizer = llm.get_tokenizer()
    state = llm.engine.core._structured_outputs().submit(StructuredOutputsParams(choice=["Jakarta", "Bandung"]))
    while not state.ready:
        time.sleep(0.01)
    jakarta = tokenizer.encode("Jakarta")
    bandung = tokenizer.encode("Bandung")
    vocab = llm.engine.hf_config.vocab_size

    def allowed(mask: TokenBitmask, row: int) -> set[int]:
        words = mask.bitmask[row]
        return {t for t in (jakarta + bandung + [2]) if (int(words[t >> 5]) >> (t & 31)) & 1}

    # drafts: all of "Jakarta" (+ EOS, which completes the grammar), so rows after each draft are filled
    mask = build_bitmask([None, state], vocab, [[5, 6], jakarta + [2]])
    assert mask.rows == list(range(3, 3 + len(jakarta) + 1))  # rows 0-2 belong to the unconstrained request
    assert allowed(mask, 3) == {jakarta[0], bandung[0]}
    assert allowed(mask, 3 + len(jakarta)) == {2}  # after the whole word only EOS is allowed
    # a draft the grammar forbids: only the rows up to it are constrained
    mask = build_bitmask([state], vocab, [[bandung[0], jakarta[-1], 7]])
    assert mask.rows == [0, 1] and jakarta[-1] not in allowed(mask, 1)
    assert state.matcher.accept_token(jakarta[0])  # the matcher was rolled back to the start
