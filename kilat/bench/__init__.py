"""``kilat bench``: measure an OpenAI-compatible server (``serve``) or the offline engine (``throughput``,
``latency``) with the metric definitions of ``docs/metrics.md``."""
