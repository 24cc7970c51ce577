"""structlog configuration: native journal entries under systemd, JSON lines when piped, a
readable console view on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from .journald import JournalLoggerFactory, as_event, under_journald


def configure_logging(
    *, level: str = "info", json: bool | None = None, journal: bool | None = None
) -> None:
    """Route every log event to journald (when stderr is its stream) or to stderr."""
    if journal is None:
        journal = json is None and under_journald()
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor
    factory: Any
    if journal:
        renderer, factory = as_event, JournalLoggerFactory()
    elif json:
        renderer = structlog.processors.JSONRenderer()
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
