"""The ``hitchllm`` logger: INFO to stderr unless the application configured logging itself.

``HITCHLLM_LOGGING_LEVEL`` (DEBUG, INFO, WARNING, ...) sets the level.
"""

from __future__ import annotations

import logging
import os

_configured = False


def init_logging() -> None:
    """Attach a stderr handler to the ``hitchllm`` logger once per process."""
    global _configured
    if _configured:
        return
    _configured = True
    logger = logging.getLogger("hitchllm")
    logger.setLevel(os.environ.get("HITCHLLM_LOGGING_LEVEL", "INFO").upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        logger.addHandler(handler)
