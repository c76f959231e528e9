"""The one root of every error sprawl raises on purpose.

Each package hangs its own tree from :class:`SprawlError` (``policies.errors``,
``orchestrator.errors``, ``environments.errors``, ``sandbox.errors``, ``staleness.errors``),
named for the layer that failed, so the command line turns any of them into a clean message and
an exit code, and anything else is a bug with a traceback.
"""

from __future__ import annotations


class SprawlError(Exception):
    """Root of every error sprawl raises on purpose; the message names what was wrong."""
