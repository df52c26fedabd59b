"""The interleaved chat workload: K conversations × T turns, served round-robin.

Each turn appends a new user message to its conversation's history and asks
for a reply. The client keeps a *fixed* assistant text in the history (not the
text a server sent back), so every engine and every server sees byte-identical
prompts and the only difference between two runs is what the engine reuses.
The synthetic tokenizers map about one character to one token (the byte-level
ones merge a few common pairs), so message lengths are roughly token counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

Message = dict[str, str]

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "are",
    "be",
    "or",
    "an",
]


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int
    turns: int
    user_chars: int  # new user text per turn (~ tokens with the synthetic tokenizers)
    reply_chars: int  # the assistant text the client keeps in its history
    max_tokens: int  # tokens each request generates
    seed: int = 0

    def _text(self, rng: random.Random, chars: int) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(_WORDS))
        return " ".join(words)[:chars]

    def requests(self) -> list[tuple[int, int, list[Message]]]:
        """``(conversation, turn, messages)`` in serving order: turn-major, round-robin."""
        rng = random.Random(self.seed)
        users = [
            [self._text(rng, self.user_chars) for _ in range(self.turns)]
            for _ in range(self.conversations)
        ]
        replies = [
            [self._text(rng, self.reply_chars) for _ in range(self.turns)]
            for _ in range(self.conversations)
        ]
        out = []
        for turn in range(self.turns):
            for conv in range(self.conversations):
                messages: list[Message] = []
                for past in range(turn):
                    messages.append({"role": "user", "content": users[conv][past]})
                    messages.append({"role": "assistant", "content": replies[conv][past]})
                messages.append({"role": "user", "content": users[conv][turn]})
                out.append((conv, turn, messages))
        return out
