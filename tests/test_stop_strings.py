"""Stop strings (jspec.stop_strings): where a row's text ends, on a tokenizer of one
character a token and on multi-character tokens, without a model."""

import numpy as np
import pytest

from jspec.stop_strings import RowText, StopWatch, check_stop_strings
from jspec.text import TextStream


class Chars:
    """A tokenizer whose ids are indexes into `vocab` (pieces of text)."""

    def __init__(self, vocab):
        self.vocab = list(vocab)

    def ids(self, *pieces):
        return [self.vocab.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.vocab[i] for i in ids)


TOK = Chars(["a", "b", "\n", "x", "y", "\n\n", "END", "bE", "ND", "é"])


def _row(stops, *pieces, prompt=()):
    r = RowText(TOK, TOK.ids(*prompt), tuple(stops))
    r.feed(TOK.ids(*pieces))
    return r


def test_a_row_stops_at_the_token_that_completes_a_stop_string():
    r = _row(["\n\n"], "a", "\n", "\n", "b")
    assert r.hit == (1, 3) and r.text[:r.hit[0]] == "a" and r.fed == 3  # "b" never fed
    # across tokens ("b" + "END" = "bEND"), inside one ("\n\n"), at the first token
    assert _row(["bEN"], "a", "bE", "ND").hit == (1, 3)
    assert _row(["\n\n"], "x", "\n\n").hit == (1, 2)
    assert _row(["a"], "a").hit == (0, 1)
    assert _row(["zz"], "a", "b").hit is None
    # The stop string that completes first wins, though another starts earlier.
    assert _row(["xaby", "ab"], "x", "a", "b", "y").hit == (1, 3)
    # Of two ending at one token, the one that starts first (the longer).
    assert _row(["b", "ab"], "x", "a", "b").hit == (1, 3)
    # The prompt is never searched, nor a string split between prompt and generation.
    assert _row(["\n\n"], "\n", "a", prompt=("a", "\n")).hit is None


def test_feeding_in_pieces_is_feeding_at_once():
    pieces = ["x", "a", "\n", "b", "\n", "\n", "a"]
    whole = _row(["\n\n"], *pieces)
    r = RowText(TOK, [], ("\n\n",))
    ids = TOK.ids(*pieces)
    for n in range(1, len(ids) + 1):  # the host's chunks: the ids so far, each time
        r.feed(ids[:n])
    assert r.hit == whole.hit == (4, 6) and r.text == whole.text


def test_what_a_stream_may_show():
    # Text that may still grow into a stop string is held back; nothing else.
    assert _row(["\n\n"], "a", "\n").safe() == 1
    assert _row(["END"], "a", "bE").safe() == 2  # "E" may become "END"
    assert _row(["END"], "a", "b").safe() == 2
    assert _row(["ab", "\n\n"], "x", "a").safe() == 1
    assert _row(["\n\n"], "a", "\n", "\n", "b").safe() == 1  # a hit: up to it


def test_a_watch_cuts_rows_and_answers_until():
    prompts = [TOK.ids("x"), TOK.ids("y")]
    w = StopWatch(TOK, prompts, ("END",))
    assert w.until(0, np.asarray(TOK.ids("a"))) is False
    assert w.until(0, np.asarray(TOK.ids("a", "END", "b"))) is True
    assert w.cut(0, TOK.ids("a", "END", "b", "b")) == (2, "a")
    assert w.cut(1, TOK.ids("b", "b")) is None


@pytest.mark.parametrize("value, message", [
    ("", r"stop_strings\[0\] is empty"),
    (["a", ""], r"stop_strings\[1\] is empty"),
    ([b"\n"], r"stop_strings\[0\] must be a string; got bytes"),
    ([7], r"stop_strings\[0\] must be a string; got int"),
    ({"a"}, "must be a string or a list of strings; got set"),
    (["\ud800"], r"stop_strings\[0\] is not valid Unicode text"),
])
def test_bad_stop_strings_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(value)


def test_stop_string_forms():
    assert check_stop_strings(None) == () == check_stop_strings([])
    assert check_stop_strings("\n\n") == ("\n\n",)
    assert check_stop_strings(["a", "b", "a"]) == ("a", "b")


def test_a_stream_holds_back_a_stop_strings_start_and_closes_its_rounds():
    # Rounds of several tokens (a speculative stream): the newline is held until "b"
    # shows it starts no stop string, "E" until "ND" shows it completes "END"; the
    # stream then stops asking for rounds (the generator closed).
    closed = []

    def rounds(*steps):
        try:
            yield from ([TOK.ids(*s) for s in steps])
        finally:
            closed.append(True)

    s = TextStream(TOK, TOK.ids("x"), rounds(("a", "\n"), ("bE",), ("ND", "b"), ("a",)),
                   stop_ids=(), stop_strings=("END", "\n\n"))
    assert list(s) == ["a", "\nb"] and s.text == "a\nb" and closed == [True]
    assert s.ids == TOK.ids("a", "\n", "bE", "ND") and s.finish_reason == "stop"
    # A stop token ends it first: its text left out, as without stop strings.
    s = TextStream(TOK, [], rounds(("a", "b"), ("END", "a")), stop_ids=TOK.ids("b"),
                   stop_strings=("END",))
    assert list(s) == ["a"] and s.ids == TOK.ids("a", "b") and s.finish_reason == "stop"
    # No stop string: everything, the held tail included, by the end.
    s = TextStream(TOK, [], rounds(("a", "bE")), stop_ids=(), stop_strings=("END",))
    assert "".join(s) == "abE" == s.text and s.finish_reason == "length"
