"""The ``kilat`` logger: INFO to stderr by default (as vLLM does), quiet with ``KILAT_LOG_LEVEL=WARNING``."""

from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    """Give the ``kilat`` logger one stderr handler at ``$KILAT_LOG_LEVEL`` (default INFO), once."""
    logger = logging.getLogger("kilat")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s kilat: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("KILAT_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
