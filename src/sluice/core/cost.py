"""Token estimates made before the engine has seen a request.

The real tokenizer lives in the engine; the gateway only needs an estimate good enough for
admission and fairness, so it uses the common rule of thumb of about four characters per token,
and the engine's reported usage settles the real count afterwards.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
# Chat templates wrap every message in role markers and separators.
TOKENS_PER_MESSAGE = 4


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def _content_tokens(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += _text_tokens(part["text"])
            else:
                # Images and audio: engines charge hundreds of tokens; be conservative.
                total += 256
        return total
    return _text_tokens(str(content))


def estimate_chat_tokens(messages: list[dict[str, Any]]) -> int:
    return 3 + sum(TOKENS_PER_MESSAGE + _content_tokens(m.get("content")) for m in messages)


def estimate_prompt_tokens(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # already token ids
    return sum(estimate_prompt_tokens(p) for p in prompt) if prompt else 1
