"""Bad input is refused at the boundary with an error naming it, on the host before
anything is traced (so the file is fast); input that is fine is read as it is."""

import json

import pytest

import jspec
from jspec.random_model import random_model

# ------------------------------------------------------------------- parse_tree fields


@pytest.mark.parametrize("text, fragment", [
    ("3,,1", r"branching '3,,1': field 2 of 3 .* is empty"),
    ("3,2,", r"branching '3,2,': field 3 of 3 .* is empty"),
    (",3", r"branching ',3': field 1 of 2 .* is empty"),
    ("dynamic:6,,60,4", r"dynamic '6,,60,4': field 2 of 4 .* is empty"),
    ("paths:0;;1", r"paths '0;;1': field 2 of 3 .* is empty"),
    ("paths:0;1;", r"paths '0;1;': field 3 of 3 .* is empty"),
    ("paths:0;1.;2", r"path '1\.': field 2 of 2 .* is empty"),
    ("spine:3:1,,0", r"side branches '1,,0': field 2 of 3 .* is empty"),
])
def test_parse_tree_refuses_empty_fields(text, fragment):
    with pytest.raises(ValueError, match=f"tree '{text}': {fragment}"):
        jspec.parse_tree(text)


def test_parse_tree_keeps_its_other_forms():
    assert jspec.parse_tree(" 3, 2 ").branching == (3, 2)
    assert jspec.parse_tree("paths:0;1;0.0").num_nodes == 3
    assert jspec.parse_tree("dynamic:4,16,5").dynamic == (4, 16, 5)
    assert jspec.parse_tree("spine:3").paths == ((0,), (0, 0), (0, 0, 0))  # no side branch
    assert jspec.parse_tree("") is None
    with pytest.raises(ValueError, match="paths is empty"):
        jspec.parse_tree("paths:")


# ------------------------------------------------------------------ read_prompts lines


def test_read_prompts_breaks_lines_at_newlines_only(tmp_path):
    odd = ["a\u2028b", "c\u0085d", "e\u2029f", "g\x1ch", "i\x0bj"]  # str.splitlines breaks
    jl = tmp_path / "p.jsonl"
    jl.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in odd),
                  encoding="utf-8")
    assert jspec.read_prompts(jl) == odd
    txt = tmp_path / "p.txt"
    txt.write_bytes("def f():\x0c    return 1\nx\u2028y\n".encode())
    assert jspec.read_prompts(txt) == ["def f():\x0c    return 1", "x\u2028y"]


def test_read_prompts_reads_crlf_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"first\r\n\r\nsecond\r\n")
    assert jspec.read_prompts(txt) == ["first", "second"]
    jl = tmp_path / "p.jsonl"
    jl.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert jspec.read_prompts(jl) == ["a", "b"]
    jl.write_bytes(b'{"prompt": "a"}\r\n{bad\r\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a JSON object"):
        jspec.read_prompts(jl)


# ------------------------------------------------------------------- random_model seed


@pytest.mark.parametrize("seed", [-1, 2**31, 2**32, True, 1.5, "a", None])
def test_random_model_refuses_seeds_outside_int32(seed):
    with pytest.raises((ValueError, TypeError), match=r"seed=.* must be an integer in "
                                                      r"\[0, 2\*\*31\)"):
        random_model("tiny-qwen3", backend="xla", dtype="float32", seed=seed)
