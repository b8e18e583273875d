"""Incremental detokenization with stop strings: what text a client may be sent so far."""

from __future__ import annotations


class TextTracker:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        # Text that could still turn out to be the start of a stop string is held back until it can't.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, output_ids: list[int], ends_with_stop_token: bool) -> bool:
        """Decode the output so far; True when a stop string appeared (the text is cut before it)."""
        ids = output_ids[:-1] if ends_with_stop_token else output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        found = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stops) if i >= 0]
        if found:
            self.text = text[: min(found)]
            return True
        self.text = text
        return False

    def take(self, finished: bool) -> str:
        """The text not yet sent that is safe to send."""
        end = len(self.text)
        if not finished:
            end -= self.holdback
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                end = min(end, len(self.text) - 1)
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:end], end
        return delta
