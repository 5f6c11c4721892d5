"""The artifact's ``special_tokens`` record, built the same way by every converter."""

from __future__ import annotations

import json
from typing import Any

from ninfer.convert.errors import ConversionError
from ninfer.convert.fields import Fields, json_kind


def added_special_tokens(tokenizer_json: str) -> dict[str, int]:
    """Spelling → id of every added token the tokenizer marks special."""
    tokens = json.loads(tokenizer_json).get("added_tokens") or []
    if not isinstance(tokens, list):
        raise ConversionError(f"tokenizer.json: added_tokens must be an array, got {json_kind(tokens)}")
    special = {}
    for index, token in enumerate(tokens):
        entry = Fields(token, "tokenizer.json", f"added_tokens[{index}].")
        content, token_id = entry.string("content"), entry.integer("id", minimum=0)
        if entry.boolean("special", False):
            special[content] = token_id
    return special


def special_tokens_record(tokenizer_json: str, bos: int | None, eos: int | list[int] | None,
                          pad: int | None) -> dict[str, Any]:
    """``{"bos_token_id", "eos_token_ids": [...], "pad_token_id", "tokens": {spelling: id}}``."""
    if eos is None:
        eos_ids: list[int] = []
    elif isinstance(eos, list):
        eos_ids = [int(e) for e in eos]
    else:
        eos_ids = [int(eos)]
    return {
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": list(dict.fromkeys(eos_ids)),
        "pad_token_id": None if pad is None else int(pad),
        "tokens": added_special_tokens(tokenizer_json),
    }
