"""Structured outputs (constrained decoding) with xgrammar: grammars from JSON schemas, regexes, choices and
EBNF, compiled off the engine step, and per-step token bitmasks for the sampler."""
