"""Token ids to text, a few at a time, never splitting a character."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDecoder:
    """Token ids in, fed a few at a time; text pieces out that never split a character.

    As HF's TextStreamer and text-generation-inference do: every push decodes the ids
    again and emits only the new suffix, holding it back while the text ends in U+FFFD
    (an unfinished UTF-8 sequence: a character split over byte tokens). The decoded
    window starts at the last emitted boundary (after `CONTEXT` ids of `context`, the
    prompt's tail, so a leading space decodes as it does after the prompt), so a push
    costs the ids since then. `text` is everything emitted; `flush()` emits what is still
    held (an unfinished character then shows as U+FFFD, as a plain decode shows it).
    """

    CONTEXT = 5

    def __init__(self, tokenizer, context: Sequence[int] = (), *,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = [int(t) for t in context][-self.CONTEXT:]
        self._prefix = 0  # window start: a boundary already emitted (or the context's start)
        self._read = len(self._ids)  # ids before this are emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, ids: Sequence[int]) -> str:
        """Adds ids; returns the text that is now complete ("" while a character is open)."""
        self._ids.extend(int(t) for t in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns whatever is still held back (the end of a generation)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += piece
        return piece


def decode_continuation(tokenizer, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """The text of generated `ids` after `prompt_ids`, exactly as streaming prints it."""
    dec = IncrementalDecoder(tokenizer, prompt_ids)
    dec.push(ids)
    dec.flush()
    return dec.text
