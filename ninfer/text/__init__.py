"""Text: tokenizer, chat templates (input side) and the output decoder (see docs/text.md).

The input side is exported here; the output side is imported from its own modules
(``ninfer.text.output`` and friends).
"""

from ninfer.text.chat_template import (QWEN_THINKING_EARLY_CLOSE, ChatFormatter, Prompt,
                                       TemplateError, TemplateKwargError, early_close_ids)
from ninfer.text.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ChatFormatter", "Prompt", "QWEN_THINKING_EARLY_CLOSE", "TemplateError", "TemplateKwargError",
    "Tokenizer", "TokenizerError", "early_close_ids",
]
