"""Incremental detokenization with stop strings: what text a client may be sent so far.

Decoding the whole output at every step costs O(n) per token (O(n²) per request); instead only a
short window is decoded: the tokens since `prefix` (already turned into text), compared with the
text of the same window without the newest tokens. Tokens that end inside a UTF-8 character
decode to U+FFFD and wait until the character completes.
"""

from __future__ import annotations


class TextTracker:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        # Text that could still turn out to be the start of a stop string is held back until it can't.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.prefix = 0  # window start: tokens before it are settled text
        self.read = 0  # tokens up to here are in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, output_ids: list[int], ends_with_stop_token: bool) -> bool:
        """Take in the newest tokens; True when a stop string appeared (the text is cut before it)."""
        ids = output_ids[:-1] if ends_with_stop_token else output_ids
        if len(ids) > self.read:
            settled = self._decode(ids[self.prefix:self.read])
            window = self._decode(ids[self.prefix:])
            if len(window) > len(settled) and not window.endswith("\ufffd"):
                self.text += window[len(settled):]
                self.prefix, self.read = self.read, len(ids)
        found = [i for i in (self.text.find(s, max(0, self.emitted - len(s))) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            return True
        return False

    def take(self, finished: bool) -> str:
        """The text not yet sent that is safe to send."""
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:end], end
        return delta
