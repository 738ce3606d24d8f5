"""Tokens to text as they come, cut at stop strings the way OpenAI cuts them.

The whole text is decoded again at every token (as `treeflash generate` streams): a character made of several
tokens appears once whole, and the text always equals `decode(tokens)`, the reference the output must match.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    """Feed tokens with `add`, which returns the text that is safe to send. The output ends right before the first
    occurrence of any stop string (not included; `stopped` is then set and later tokens are ignored). Text that
    could be the start of a stop string, or ends in a partial character, is held back until it is resolved."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] = ()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []  # the tokens that made the text (none after a stop)
        self.text = ""  # the output so far, cut at a stop
        self.sent = ""  # the part of it handed out
        self.stopped = False

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._release(cut)
        self.text = text
        return self._release(len(text) - self._held(text))

    def finish(self) -> str:
        """The rest of the text, once no token will come."""
        rest = self.text[len(self.sent):]  # best effort should an earlier character have changed
        self.sent = self.text
        return rest

    def _held(self, text: str) -> int:
        """Characters at the end that must wait: a partial character, or a prefix of a stop string."""
        if text.endswith("\ufffd"):
            return len(text)
        for k in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                return k
        return 0

    def _release(self, end: int) -> str:
        if not self.text.startswith(self.sent):  # an earlier character changed: wait (the end is sent as it is)
            return ""
        delta = self.text[len(self.sent):end]
        self.sent += delta
        return delta
