"""The OpenAI-compatible HTTP server (``kilat serve``)."""
