"""Stop strings: a row ends where its text first contains one of them.

The text is the row's continuation as streaming prints it (`IncrementalDecoder`, fed one
token at a time), so where a row stops never depends on how the run was chunked, on the
batch, or on speculative against serial decoding: the tokens are the same (property P),
and so is their text. A row stops at the token that completes a stop string (the string
that completes first; on a tie the one that starts first); its text is cut before the
string, its ids keep that token (as a stop token is kept). Only generated text is
searched, never the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jspec.detokenize import IncrementalDecoder


def check_stop_strings(value) -> tuple[str, ...]:
    """None, a string, or a list / tuple of non-empty strings -> a tuple of distinct
    strings (order kept); anything else is a ValueError naming it."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple):
        raise ValueError(f"stop_strings must be a string or a list of strings; got "
                         f"{type(value).__name__} {value!r:.80}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise ValueError(f"stop_strings[{i}] must be a string; got "
                             f"{type(s).__name__} {s!r:.80}")
        if not s:
            raise ValueError(f"stop_strings[{i}] is empty: an empty string would stop "
                             "every row before its first token")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"stop_strings[{i}] is not valid Unicode text: a lone "
                             f"surrogate {s[e.start]!r} at character {e.start}") from None
    return tuple(dict.fromkeys(value))


class RowText:
    """One row's continuation, fed token by token; `hit` (start, tokens) once a stop
    string is complete: the text is cut at `start`, `tokens` ids are kept."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stops: tuple[str, ...]):
        self._dec = IncrementalDecoder(tokenizer, prompt_ids)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self.fed = 0  # ids pushed
        self.hit: tuple[int, int] | None = None

    @property
    def text(self) -> str:
        return self._dec.text

    def feed(self, ids: Sequence[int]) -> bool:
        """Pushes ids[self.fed:] one at a time until a stop string completes; True once
        one has (the row is over)."""
        for t in ids[self.fed:]:
            if self.hit is not None:
                break
            before = len(self._dec.text)
            self._dec.push([int(t)])
            self.fed += 1
            if len(self._dec.text) > before:
                self.hit = self._match(before)
        return self.hit is not None

    def _match(self, before: int) -> tuple[int, int] | None:
        """The stop string that ends first (then starts first) among those ending in the
        text added since `before`, as (start, tokens fed)."""
        text = self._dec.text
        lo = max(0, before - self._longest + 1)
        best = None
        for s in self._stops:
            i = text.find(s, lo)
            while i != -1 and i + len(s) <= before:  # ended earlier: seen already
                i = text.find(s, i + 1)
            if i != -1:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[1], self.fed)

    def flush(self) -> str:
        """The whole text, with what the decoder still held (the end of a generation)."""
        self._dec.flush()
        return self._dec.text

    def safe(self) -> int:
        """How much of the text can be shown: all but its longest tail that may still
        grow into a stop string (all of it once a stop string is complete: up to it)."""
        text = self._dec.text
        if self.hit is not None:
            return self.hit[0]
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return len(text) - n
        return len(text)


class StopWatch:
    """The stop strings of a batch: `until(row, ids)` for `jspec.generate` /
    `jspec.speculative_generate` (a row ends at the first chunk after its text holds one),
    and `cut(row, ids)` for the output."""

    def __init__(self, tokenizer, prompt_ids: Sequence[Sequence[int]],
                 stops: tuple[str, ...]):
        self.rows = [RowText(tokenizer, p, stops) for p in prompt_ids]

    def until(self, row: int, ids: np.ndarray) -> bool:
        return self.rows[row].feed(ids.tolist())

    def cut(self, row: int, ids: Sequence[int]) -> tuple[int, str] | None:
        """(ids kept, text) where a stop string ended the row, else None."""
        r = self.rows[row]
        if r.feed(list(ids)):
            return r.hit[1], r.text[:r.hit[0]]
        return None
