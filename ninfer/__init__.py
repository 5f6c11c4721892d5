"""NInfer: one Python process, one GPU, one resident model, three chat APIs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Engine pulls in trio and the scheduler; keep `import ninfer` cheap for converters.
    if name == "Engine":
        from ninfer.engine.api import Engine

        return Engine
    raise AttributeError(name)
