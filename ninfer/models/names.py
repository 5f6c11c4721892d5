"""The canonical tensor layout every decoder family shares around its own layers."""

from __future__ import annotations

from typing import Any, Callable

LayerNames = Callable[[Any, int], dict[str, tuple[int, ...]]]


def decoder_tensor_names(config: Any, layer_names: LayerNames) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the ``text`` component with its shape, in file order: ``embed``,
    each layer's tensors (``layer_names(config, i)``), ``final_norm``, then ``lm_head`` unless the
    embeddings are tied."""
    names: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_layers):
        names.update(layer_names(config, layer))
    names["final_norm"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        names["lm_head"] = (config.vocab_size, config.hidden_size)
    return names
