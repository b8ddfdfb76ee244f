"""The parity-audit building blocks (jspec/audit.py) on tiny fixture models."""

import numpy as np
import pytest
from conftest import expected, load

import jspec
from jspec import audit


def _seq():
    e = expected("qwen3")
    return np.concatenate([e["prompt"], e["greedy"]]).astype(np.int32)


@pytest.mark.slow  # the audit's controls; the engine's audit by default: test_speculative.py
def test_same_prefix_controls_equal_on_pallas_and_explained_on_xla():
    seq = _seq()
    ok = audit.same_prefix_controls(load("qwen3", "pallas"), seq[:14], seq[14:], 4)
    assert ok["equal"] and set(ok["histories"]) == {
        "one-token commits", "accepted blocks of 4", "fresh prefill"}
    assert all(h["argmax_only_path_equals_inspected"] for h in ok["histories"].values())
    bad = audit.same_prefix_controls(load("qwen3", "xla"), seq[:14], seq[14:], 4)
    assert not bad["equal"]
    firsts = [v["first_mismatch"] for h in bad["histories"].values() for v in h.values()
              if isinstance(v, dict) and not v["equal"]]
    assert firsts and all(len(f["top_k_a"]) == 5 and f["position"] >= 13 for f in firsts)
    assert ok["prefix_digest"] == audit.digest(seq[:14]) == bad["prefix_digest"]


def test_exact_ties_break_to_the_lowest_index_everywhere():
    model = load("gemma3", "pallas")
    prompt = expected("gemma3")["prompt"]
    seq = np.concatenate([prompt, jspec.generate(model, [prompt], max_new_tokens=16).tokens[0]])
    base, _ = jspec.forward(model, seq[None], jspec.init_cache(model, 1, len(seq)))
    # Twin every token that is the argmax somewhere on seq: every row then has a tied max.
    tied, pairs = audit.tie_model(model, np.argmax(np.asarray(base[0]), -1))
    logits, _ = jspec.forward(tied, seq[None], jspec.init_cache(tied, 1, len(seq)))
    res = audit.tie_breaks(np.asarray(logits[0]), pairs)
    assert res["tie_rows"] == len(seq)
    assert res["bitwise_equal_twins"] == res["argmax_lowest_index"] == res["tie_rows"]
    serial = jspec.generate(tied, [prompt], max_new_tokens=16)
    spec = jspec.speculative_generate(tied, jspec.ModelDrafter(tied), [prompt],
                                      jspec.SpecConfig(gamma=3, max_new_tokens=16))
    assert spec.row(0) == serial.row(0)


def test_near_ties_uses_one_bf16_ulp_at_the_logit_magnitude():
    rows = np.array([[10.0, 10.0 + 2**-5, 1.0],   # gap 1/32 < ulp(10) = 1/16: tie
                     [10.0, 10.25, 1.0],           # gap 1/4: no
                     [0.5, 0.5 + 2**-10, 0.0]],    # ulp(0.5) = 2**-8: tie
                    np.float32)
    assert audit.near_ties(rows) == [0, 2]


@pytest.mark.slow  # the audit's bookkeeping; its bits: the tests above and below
def test_prefix_controls_share_histories_across_ks_and_check_capacity():
    seq = _seq()
    model = load("qwen3", "pallas")
    ks = [1, 3, 4]
    res = audit.prefix_controls(model, seq[:14], seq[14:], ks)
    assert [r["k"] for r in res] == ks and all(r["equal"] for r in res)
    # k = 4 alone gives the same verdicts and rows as k = 4 among others.
    alone = audit.same_prefix_controls(model, seq[:14], seq[14:], 4)
    assert alone == res[-1]
    with pytest.raises(ValueError, match="max_len 20 is too small"):
        audit.prefix_controls(model, seq[:14], seq[14:], ks, max_len=20)
    with pytest.raises(ValueError, match="proposals given"):
        audit.prefix_controls(model, seq[:14], seq[14:16], ks)
