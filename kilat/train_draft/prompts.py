"""The training prompts ``kilat train-draft`` uses by default: chat requests drawn from the recipe of the W6
workload (docs/workloads.md) — a text of 18 to 288 words from W6's 72-word list, then a task — with a seeded
generator, so that they are not W6's own 64 prompts (which stay held out), plus four tasks W6 does not ask."""

from __future__ import annotations

import random

WORDS = ("answer", "art", "attention", "autumn", "batch", "bridge", "cache", "castle", "city", "client", "color",
         "data", "desert", "engine", "evening", "forest", "garden", "harbor", "history", "input", "island", "kernel",
         "key", "latency", "layer", "letter", "library", "light", "market", "matrix", "meadow", "memory", "model",
         "morning", "mountain", "museum", "music", "network", "night", "number", "ocean", "output", "poem",
         "process", "prompt", "python", "query", "question", "queue", "request", "river", "school", "science",
         "server", "shadow", "sound", "spring", "station", "story", "stream", "summer", "system", "the", "thread",
         "throughput", "token", "valley", "value", "vector", "village", "weight", "winter")
"""W6's word list."""

TASKS = ("Summarize the text above in three sentences.",
         "List five keywords from the text above and explain each one.",
         "Write a short story that uses the words above.",
         "Explain what the text above could mean to a child.",
         "Write a poem inspired by the text above.",
         "Describe a place that the words above bring to mind.",
         "Give three questions someone might ask about the text above.",
         "Rewrite the text above as a short news report.")
"""W6's four tasks, then four more."""


def chat_prompts(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``count`` single-message chat conversations (OpenAI message dicts), the same for the same ``seed``.

    Raises:
        ValueError: ``count`` < 1.
    """
    if count < 1:
        raise ValueError(f"num_prompts must be >= 1, got {count}")
    rng = random.Random(seed)
    return [[{"role": "user", "content": "Text: " + " ".join(rng.choices(WORDS, k=rng.randint(18, 288)))
              + "\n\n" + TASKS[i % len(TASKS)]}] for i in range(count)]
