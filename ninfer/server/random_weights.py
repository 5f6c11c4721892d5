"""What `ninfer serve --random-weights CONFIG` serves in place of an artifact.

The text side is exactly the header ``ninfer convert --random`` would write for CONFIG (synthetic
Qwen-style tokenizer and chat template, special tokens, metadata), held in memory; the weights are
made on the GPU by the CUDA runner (``ninfer.backends.cuda.random_weights``), so no file exists.
"""

from __future__ import annotations

from typing import Any

from ninfer.convert.random_model import random_header_fields, resolve_config
from ninfer.models.dense import DenseConfig

SEED = 0


class RandomWeightsModel:
    """The attributes of an opened artifact the server reads (``metadata``, ``config``, ``tokenizer_json``,
    ``chat_template``, ``special_tokens``, ``generation``), plus the dense config and ``visible_ids``."""

    def __init__(self, spec: str, seed: int = SEED):
        try:
            config, preset = resolve_config(spec)
        except ValueError as e:
            raise ValueError(str(e).replace("--random:", "--random-weights:")) from None
        if not isinstance(config, DenseConfig):
            raise ValueError(f"--random-weights: the CUDA backend runs dense models; {spec} is {config.architecture}")
        self.spec = spec
        self.seed = seed
        self.dense = config
        header = random_header_fields(config, seed, preset)
        self.metadata: dict[str, Any] = header["metadata"]
        self.config: dict[str, Any] = header["config"]
        self.tokenizer_json: str = header["tokenizer"]["json"]
        self.chat_template: str = header["chat_template"]
        self.special_tokens: dict[str, Any] = header["special_tokens"]
        self.generation: dict[str, Any] = header["generation"]

    @property
    def visible_ids(self) -> int:
        """Ids the synthetic tokenizer spells (its vocabulary and added tokens)."""
        from ninfer.text import Tokenizer

        return Tokenizer.from_artifact(self).vocab_size

    @property
    def source(self) -> str:
        """How logs and the request log name it, where an artifact would give its path."""
        return f"random-weights:{self.spec}"
