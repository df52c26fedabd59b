"""A reply's reasoning (``<think>…</think>``) split from its answer, whole or as it streams.

Thinking models write their reasoning first, in a block the answer follows
(Qwen3.5: ``<think>\\nREASONING</think>\\n\\nANSWER``). A template that opens the
block in the generation prompt (Qwen3.5's with thinking on) leaves the reply
starting inside it; one that does not lets the model open it itself. The
server returns the reasoning apart from the answer (``reasoning_content`` on
chat, ``thinking`` blocks on Anthropic's route, a ``reasoning`` item on
Responses), as vLLM's reasoning parsers do, so tool calls are parsed from the
answer alone and a client sending the answer back does not resend the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    """How one prompt's replies begin: inside a think block (``opened``), or
    free to open one."""

    opened: bool

    @classmethod
    def of(cls, prompt: str, template: str | None, constrained: bool) -> Reasoning | None:
        """The split for a reply to the rendered *prompt*, or None when there is
        none to make: the template knows no think block, or a grammar constrains
        the reply from its first token (a forced tool call, a response format),
        so all of it is the answer whatever block the prompt left open."""
        if constrained or OPEN not in (template or ""):
            return None
        start = prompt.rfind(OPEN)
        return cls(opened=start >= 0 and CLOSE not in prompt[start:])

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, answer)`` of a whole reply; reasoning None when it has none.
        A reply that ends inside its block (cut by ``max_tokens``) is all reasoning."""
        splitter = self.splitter()
        reasoning, answer = splitter.feed(text)
        more, rest = splitter.finish()
        reasoning += more
        return (reasoning if splitter.reasoned else None), answer + rest

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.opened)


class ReasoningSplitter:
    """Streamed text in, ``(reasoning, answer)`` deltas out. Text that may still
    become a marker (a reply's leading ``<th``, a trailing ``</thi``) is held back
    until the next delta settles it, so no marker ever reaches a client."""

    def __init__(self, opened: bool) -> None:
        # "start": the reply may open a block; "inside": reasoning; "after": the
        # answer's leading newlines still to drop; "answer": the rest.
        self._state = "inside" if opened else "start"
        self.reasoned = opened
        self._held = ""

    @property
    def answering(self) -> bool:
        """Past the reasoning, with nothing held: every later delta is answer as it is."""
        return self._state == "answer" and not self._held

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, answer = "", ""
        while self._held:
            if self._state == "start":
                lead = self._held.lstrip()
                if lead.startswith(OPEN):
                    self._held, self._state, self.reasoned = lead[len(OPEN) :], "inside", True
                elif OPEN.startswith(lead):  # blank, or a marker's start: wait for more
                    break
                else:
                    self._state = "answer"
            elif self._state == "inside":
                at = self._held.find(CLOSE)
                if at >= 0:
                    reasoning += self._held[:at]
                    self._held, self._state = self._held[at + len(CLOSE) :], "after"
                    continue
                keep = _partial_tail(self._held, CLOSE)
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            elif self._state == "after":
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = "answer"
            else:
                answer += self._held
                self._held = ""
        return reasoning, answer

    def take(self, text: str, last: bool) -> tuple[str, str]:
        """:meth:`feed`, and on the reply's *last* chunk what was held back too:
        ``(reasoning, answer)`` of one streamed chunk."""
        reasoning, answer = self.feed(text)
        if last:
            more, rest = self.finish()
            reasoning, answer = reasoning + more, answer + rest
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end."""
        held, self._held = self._held, ""
        if self._state == "inside":
            return held, ""
        return "", held if self._state != "after" else ""


def _partial_tail(text: str, marker: str) -> int:
    """The length of *text*'s longest suffix that is a proper prefix of *marker*."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
