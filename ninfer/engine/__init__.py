"""The Engine: admission, scheduling, KV pages, prefix reuse, sampling resolution and stats.

Public names: ``Engine`` (trio facade), ``EngineConfig``, ``GenerationRequest``,
``SamplingOverrides``, ``ThinkingControl``; events in ``ninfer.engine.events``; errors in
``ninfer.engine.errors``. See docs/engine.md.
"""

from ninfer.engine.config import EngineConfig
from ninfer.engine.request import GenerationRequest, SamplingOverrides, ThinkingControl


def __getattr__(name: str):
    if name == "Engine":  # keep importing the config cheap (no trio) for the CLI
        from ninfer.engine.api import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "GenerationRequest", "SamplingOverrides", "ThinkingControl"]
