"""The command-line entry points run end to end (tiny model made on the fly)."""

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import fixture_path
from script_runner import run_script

import jspec
from jspec import cli
from jspec.bench import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Benchmarks plot their receipts: matplotlib is the `plot` extra, not a test dependency.
PLOT_EXTRA = "the benchmark plots need the plot extra: pip install 'jspec[plot]'"


def _run(script, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", script), *flags]
    return run_script(cmd, cwd=ROOT, timeout=300)


def _one_line_error(r, *words, code=2):
    """A user's mistake: exit code 2 and one line on stderr, `error: ...`, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, r.stderr[-2000:]
    assert lines[-1].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in lines[-1], lines[-1]


def test_generate_cli_chat_prompts_stream_and_jsonl(tmp_path):
    # The official Gemma 3 layout: two chats from a .txt file (different lengths, one
    # length bucket), streamed, written as JSONL; each stops at generation_config's EOS ids.
    from jspec.tiny import write_tiny_gemma3_pair

    target, _ = write_tiny_gemma3_pair(str(tmp_path / "gemma3"))
    (tmp_path / "prompts.txt").write_text('Say é\nWrite x = "éé"\n')
    out = tmp_path / "out.jsonl"
    r = _run("generate.py", f"--config={ROOT}/configs/generate.py:runlocal",
             f"--config.checkpoint={target}", f"--config.prompts={tmp_path / 'prompts.txt'}",
             "--config.chat=True", "--config.stream=True", f"--config.output={out}",
             "--config.stop_strings=('never seen',)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stop ids [1, 106], stop strings ['never seen']" in r.stdout
    assert "Pallas interpret mode" in r.stdout
    assert "compiled programs for 1 shape over 2 prompts: serial 1 (32/" in r.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["prompt"][0]["content"] for rec in records] == ["Say é", 'Write x = "éé"']
    tok = jspec.load_tokenizer(target)
    for rec in records:
        assert f"[user] {rec['prompt'][0]['content']}\n[assistant] {rec['text']}\n" in r.stdout
        assert rec["prompt_ids"][0] == 2 and rec["prompt_ids"].count(2) == 1  # one BOS
        ids = rec["ids"][:-1] if rec["finish_reason"] == "stop" else rec["ids"]
        assert rec["text"] == tok.decode(ids, skip_special_tokens=True)
        assert rec["stats"]["prompt_bucket"] == 32 and len(rec["ids"]) <= 8


# Slow: CI's newest-stack job runs the README's main command (this script, its parity
# check) every run; gumbel_coupled's parity is also tests/test_speculative.py's.
@pytest.mark.parametrize("policy", ["exact_greedy", "gumbel_coupled"])
@pytest.mark.slow
def test_speculative_cli_checks_parity(policy, tmp_path):
    # Two prompts of different lengths from a JSONL file: one compiled shape per phase,
    # parity per prompt and in the summary, one JSONL record per prompt.
    prompts = [{"prompt": "import os\n"}, {"prompt": "def norm(x, y):\n    return"}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.policy={policy}", f"--config.prompts={tmp_path / 'prompts.jsonl'}",
             f"--config.output={out}", "--config.stop_strings='never seen'")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stop strings ['never seen']" in r.stdout  # reaches both runs (none ends)
    assert "embedded code pair" in r.stdout and "acceptance" in r.stdout
    assert r.stdout.count("PARITY: OK") == 3 and "PARITY: OK (2 prompts" in r.stdout
    assert "speedup" in r.stdout and "summary over 2 prompts" in r.stdout
    # By default the pair drafts with its feature head, on xla (no interpret mode).
    assert "drafter=feature head" in r.stdout and "head backend: xla" in r.stdout
    assert ("compiled programs for 2 shapes over 2 prompts: speculative 1 (16/64), "
            "serial 1 (16/32)") in r.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["prompt"] for rec in records] == [p["prompt"] for p in prompts]
    for rec in records:
        assert rec["parity"] is True and len(rec["ids"]) == 16 and rec["text"]
        assert rec["stats"]["prompt_bucket"] == 16 and rec["speedup"] > 0
        assert f"{rec['prompt']}{rec['text']}\n" in r.stdout


def test_a_streamed_adaptive_rejection_sampling_run_may_differ_from_the_timed_one():
    # speculative_decode compared a streamed run's tokens with the timed run's and called
    # any difference an engine bug (exit 1); under an adaptive schedule (shapes picked by
    # timing) a distribution-exact policy's tokens may differ.
    from jspec.adaptive import Adaptive
    from jspec.cli import streams_must_match

    adaptive = Adaptive(gammas=(0, 1, 2))
    assert not streams_must_match(jspec.RejectionSampling(), adaptive)
    assert streams_must_match(jspec.RejectionSampling(), None)
    assert streams_must_match(jspec.ExactGreedy(), adaptive)
    assert streams_must_match(jspec.GumbelCoupled(), adaptive)


def test_draft_options_auto_leave_the_latency_kernels_to_gpus():
    # On a CPU a draft runs without the GPU latency kernels (they ran interpreted: the
    # main command's speculation fell to 0.19x serial); on a GPU a narrow draft gets them.
    from jspec.options import DraftOptions, draft_options_for

    draft = jspec.load_hf(jspec.default_pair()[1], backend="xla")
    assert draft_options_for(draft, "cpu") == DraftOptions()
    assert draft_options_for(draft, "gpu") == DraftOptions.latency()


_SPEC = ("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal")
_GEN = ("generate.py", f"--config={ROOT}/configs/generate.py:runlocal")


def test_cli_errors_are_one_line(tmp_path):
    # A misspelled config key (ml_collections raises it while absl parses the flags), a
    # checkpoint that is not one, a bad line of a prompts file.
    _one_line_error(_run(*_SPEC, "--config.gama=2"), "--config.gama", 'did you mean "gamma"')
    _one_line_error(_run(*_GEN, f"--config.checkpoint={tmp_path}/missing"),
                    "missing: not a checkpoint directory")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": 1}\n')
    _one_line_error(_run(*_GEN, f"--config.prompts={tmp_path}/bad.jsonl"), "bad.jsonl:2")
    _one_line_error(_run(*_SPEC, "--config.stop_strings=('\\n', '')"),
                    "stop_strings[1] is empty")
    # Another entry point's config (a key it lacks was a traceback, exit 1), and a preset
    # that does not exist (silently the full run).
    _one_line_error(_run("generate.py", f"--config={ROOT}/configs/speculative.py"),
                    "the config has no key 'checkpoint'", "this entry point's config")
    _one_line_error(_run("generate.py", f"--config={ROOT}/configs/generate.py:runlocl"),
                    "--config: configs/generate.py:runlocl: the one preset is 'runlocal'")


def test_running_the_option_module_points_to_the_entry_points():
    """`python -m jspec.cli --help` printed nothing and exited 0 (it is a module of the
    entry points, not one); it names them in one line and exits 2."""
    r = subprocess.run([sys.executable, "-m", "jspec.cli", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    _one_line_error(r, "experiments/generate.py", "experiments/speculative_decode.py")


def test_a_setting_the_drafter_does_not_read_is_one_line():
    # The default drafter (the pair's feature head) reads no --config.max_ngram: it was
    # dropped, exit 0; the slow run checks the other fields of jspec.cli.DRAFTER_FIELDS.
    _one_line_error(_run(*_SPEC, "--config.max_ngram=9"), "--config.max_ngram does not "
                    "apply: the drafter here is a feature head, and only prompt lookup reads it")


def test_an_output_under_a_file_is_called_a_file(tmp_path):
    # It was "the directory ... does not exist" of a path that exists: a file.
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="afile' is a file, not a directory"):
        cli.check_output(str(tmp_path / "afile" / "out.jsonl"))
    with pytest.raises(ValueError, match="no' does not exist"):
        cli.check_output(str(tmp_path / "no" / "out.jsonl"))


@pytest.mark.slow  # further mistakes through the same one-line path
def test_more_cli_errors_are_one_line(tmp_path):
    # --debug shows the traceback instead.
    r = _run(*_GEN, f"--config.checkpoint={tmp_path}/missing", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "CheckpointError" in r.stderr
    _one_line_error(_run(*_SPEC, "--config.gamma=100"), "MAX_GAMMA")
    _one_line_error(_run(*_GEN, f"--config.prompts={tmp_path}/missing.txt"), "does not exist")
    _one_line_error(_run(*_GEN, "--config.chat=True"), "no chat template")  # the code pair
    # An output path that cannot be written, or no timed runs: before anything runs.
    _one_line_error(_run(*_GEN, f"--config.output={tmp_path}/no/dir/out.jsonl"),
                    "does not exist")
    _one_line_error(_run(*_SPEC, f"--config.output={tmp_path}"), "is a directory")
    _one_line_error(_run(*_GEN, f"--config.prompts={tmp_path}"), "is a directory; give a file")
    _one_line_error(_run(*_GEN, "--config.output=/proc/out.jsonl"), "cannot write")
    _one_line_error(_run(*_SPEC, "--config.timing_runs=0"), "timing_runs=0")
    # A checkpoint the chosen drafter does not read (it was dropped without a word).
    _one_line_error(_run(*_SPEC, "--config.drafter=feature",
                         f"--config.draft={ROOT}/jspec/assets/codepair/draft"),
                    "--config.drafter=feature drafts without --config.draft")
    _one_line_error(_run(*_SPEC, "--config.drafter=prompt_lookup", f"--config.head={tmp_path}"),
                    "drafts without --config.head")
    # A setting the chosen drafter never reads (each was dropped, exit 0).
    _one_line_error(_run(*_SPEC, "--config.draft_options=draft_warps=8"),
                    "--config.draft_options does not apply: the drafter here is a feature head")
    _one_line_error(_run(*_SPEC, "--config.drafter=prompt_lookup", "--config.draft_backend=xla"),
                    "--config.draft_backend does not apply: the drafter here is prompt lookup")
    _one_line_error(_run(*_SPEC, "--config.drafter=model", "--config.draft_head_size=5"),
                    "--config.draft_head_size does not apply without --config.draft_head")
    if jax.default_backend() == "cpu":  # JAX_PLATFORMS=cuda without a GPU: jax asserted
        r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", _GEN[0]),
                            _GEN[1]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "JAX_PLATFORMS": "cuda"})
        _one_line_error(r, "JAX_PLATFORMS='cuda': jax started no backend")
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f():\n")
    _one_line_error(_run(*_GEN, f"--config.prompts={prompts}", f"--config.output={prompts}"),
                    "is the prompts file")
    assert prompts.read_text() == "def f():\n"


def test_an_output_files_partial_records_outlive_the_next_run(tmp_path, capsys):
    # A failed run leaves its records in out.jsonl.partial; the next run truncated it.
    from jspec.cli import OutputFile

    out = str(tmp_path / "out.jsonl")
    with open(out + ".partial", "w") as f:
        f.write('{"earlier": 1}\n')
    (tmp_path / "out.jsonl.partial.1").write_text("older\n")
    with OutputFile(out) as o:
        o.write({"new": 2})
    assert (tmp_path / "out.jsonl.partial.2").read_text() == '{"earlier": 1}\n'
    assert (tmp_path / "out.jsonl.partial.1").read_text() == "older\n"
    assert (tmp_path / "out.jsonl").read_text() == '{"new": 2}\n'
    assert "kept as" in capsys.readouterr().err


def test_an_output_file_is_replaced_only_by_a_finished_run(tmp_path):
    # A prompt too long for the model (the code pair's 4,096 positions) is refused before
    # the first prompt runs, and an existing output file stays as it was.
    out = tmp_path / "out.jsonl"
    out.write_text('{"old": "kept"}\n')
    (tmp_path / "prompts.txt").write_text("import os\n" + "x = 1; " * 3000 + "\n")
    for cmd in (_GEN, _SPEC):
        r = _run(*cmd, f"--config.prompts={tmp_path / 'prompts.txt'}",
                 f"--config.output={out}")
        _one_line_error(r, "prompt 2 of 2:", "exceeds the model's max_position_embeddings")
        assert "import os" not in r.stdout  # nothing ran
        assert out.read_text() == '{"old": "kept"}\n'


def test_parity_audit_checks_its_flags_before_loading(tmp_path):
    # Each mistake: one line, exit code 2, and no model loaded (no receipt written).
    for flags, words in ((["--tree=x,2"], ("--tree", "'x' is not an integer")),
                         (["--ks=1,a"], ("--ks", "'a' is not an integer")),
                         ([f"--checkpoint={fixture_path('qwen3')}", "--preset=tiny-llama"],
                          ("--preset shapes a random preset model", "drop --preset"))):
        _one_line_error(_run("parity_audit.py", *flags, f"--out={tmp_path}"), *words)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # the stop: tests/test_numerics.py; the one-line error: the test above
def test_speculative_cli_stops_on_non_finite_logits(tmp_path):
    # Finite weights whose logits overflow (a final norm weight of 3e38): the run ends
    # with a one-line error and exit code 1, never "PARITY: OK".
    import shutil

    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(jspec.default_pair()[0], target)
    tensors = load_file(target / "model.safetensors")
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"],
                                                ml_dtypes.bfloat16(3e38))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.target={target}", "--config.drafter=prompt_lookup",
             "--config.backend=xla")
    _one_line_error(r, "NaN or inf", code=1)
    assert "PARITY" not in r.stdout


@pytest.mark.slow  # the pruned head's exactness is tests/test_pruned_head.py's
def test_speculative_cli_with_a_pruned_draft_head(tmp_path):
    # The head keeps the 300 most frequent tokens of a text (here a piece of Python);
    # the output must still equal serial decoding.
    corpus = tmp_path / "corpus.py"
    corpus.write_text(open(f"{ROOT}/jspec/drafters.py").read())
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.draft_head={corpus}", "--config.draft_head_size=300")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK" in r.stdout and "[draft head: 300 of" in r.stdout
    bad = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
               f"--config.draft_head={tmp_path}/missing.npy")
    assert bad.returncode != 0 and "no such file" in bad.stderr
    # A head to prune but a drafter without one: an error, not a silently unused flag.
    bad = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
               f"--config.draft_head={corpus}", "--config.drafter=feature")
    assert bad.returncode != 0 and "use --config.drafter=model" in bad.stderr


@pytest.mark.slow  # a further case of a property the default run proves
def test_bench_e2e_smoke(tmp_path):
    pytest.importorskip("matplotlib", reason=PLOT_EXTRA)
    r = _run("bench_e2e.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--batches=1",
             "--prompt_len=16", "--max_new_tokens=8", "--gammas=2", "--accept=0.8", "--iters=1",
             "--nopeers", "--draft_backend=xla", "--oracle_seeds=2", "--draft_head=256",
             "--adaptive=0,2", "--stops=2", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "bench_e2e.json") as f:
        rep = json.load(f)
    assert 1 <= len(rep["stops"]["1"]) <= 2  # rows stop at them, serial and speculative
    assert rep["complete"] and rep["copy_TBps"] > 0 and rep["peers"]["skipped"] == "--nopeers"
    assert rep["oracle_waits_for_draft"] is True and rep["draft_head"] == 256
    assert rep["draft_backend"] == "xla"
    assert {(s["backend"], s["batch"]) for s in rep["serial"]} == {("pallas", 1), ("xla", 1)}
    assert all(s["roofline_tokens_per_s"] > 0 for s in rep["serial"])
    # the prefill timed at generate's own cache capacity, so decode = run - prefill
    assert all(s["generate_stats"]["max_len"] >= 24 and s["prefill_timed_alone"]
               for s in rep["serial"])
    assert all("decode_speedup" in s for s in rep["speculative"])
    # The speculative prefill in its two parts, once a drafter kind and batch.
    parts = [s["prefill_parts"] for s in rep["speculative"] if "prefill_parts" in s]
    assert len(parts) == 2 and all(min(p.values()) > 0 for p in parts)
    assert {(s["drafter"], s["gamma"]) for s in rep["speculative"]} == {("oracle", 2),
                                                                        ("lookup", 2)}
    assert all(s["parity"] for s in rep["speculative"])
    # The loop's rounds and how many of its row slots were live (a done row rides along).
    assert all(s["loop_rounds"] > 0 and 0 < s["live_row_fraction"] <= 1
               and s["decode_s_per_round"] > 0 for s in rep["speculative"])
    # Each timed row says what the GPU ran at; a CPU run says there was nothing to read.
    assert all("gpu" in s for s in rep["serial"] + rep["speculative"])
    # Where each run's time went: every loop call, inside the loop's time.
    for s in rep["speculative"]:
        tl = s["timeline"]
        assert tl["calls"] and 0 < tl["calls_s"] <= tl["loop_s"]
    assert all(s["generate_stats"]["timeline"]["calls"] for s in rep["serial"])
    assert "host ms" in r.stdout
    # The adaptive rows (the timed runs start from the warm-up's measured costs).
    adapt = [s for s in rep["speculative"] if s.get("adaptive")]
    assert adapt and all(s["parity"] and s["adaptive_costs_from_warmup"] for s in adapt)
    oracle = next(s for s in rep["speculative"] if s["drafter"] == "oracle"
                  and not s.get("adaptive"))
    assert [r["seed"] for r in oracle["seeds"]] == [0, 1] and rep["oracle_seeds"] == 2
    assert all(r["parity"] for r in oracle["seeds"])
    for name in ("speedup_vs_gamma", "tokens_per_s_vs_acceptance"):
        assert (tmp_path / f"bench_e2e_{name}.png").exists()
    # Receipts (runs cut short too) re-drawn without running anything.
    r = _run("bench_e2e.py", f"--replot={tmp_path / 'bench_e2e.json'}", f"--out={tmp_path}",
             "--tag=again")
    assert r.returncode == 0 and "serial greedy" in r.stdout, r.stderr[-2000:]
    # Under its own name, beside the merged receipt: the run's plots are never replaced.
    assert (tmp_path / "bench_e2e_replot_again_speedup_vs_gamma.png").exists()
    assert json.load(open(tmp_path / "bench_e2e_replot_again.json"))["speculative"]
    bad = _run("bench_e2e.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--nopeers",
               "--draft_head=100000", f"--out={tmp_path}")
    assert bad.returncode != 0 and "exceeds the draft's vocabulary (512)" in bad.stderr
    bad = _run("bench_e2e.py", "--target=tiny-qwen3", "--stops=2", f"--out={tmp_path}")
    assert bad.returncode != 0 and "add --nopeers" in bad.stderr
    bad = _run("bench_e2e.py", "--accept=0.9", "--rank_probs=0.2", "--tree=3,2", "--nopeers",
               f"--out={tmp_path}")
    assert bad.returncode != 0 and "exceed 1" in bad.stderr
    bad = _run("bench_e2e.py", "--rank_probs=x", "--nopeers", f"--out={tmp_path}")
    assert bad.returncode != 0 and "take numbers" in bad.stderr


@pytest.mark.slow  # an experiment script's run; its engine calls are the default run's
def test_eval_pair_smoke(tmp_path):
    pytest.importorskip("matplotlib", reason=PLOT_EXTRA)
    r = _run("eval_pair.py", "--num_prompts=2", "--batch=2", "--max_new_tokens=8",
             "--gammas=2", "--policies=exact_greedy", "--iters=1", "--nopeers",
             f"--out={tmp_path}", "--tag=smoke")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "eval_pair_cpu_smoke.json"))
    assert rep["runs"][0]["parity"] and rep["runs"][0]["gamma"] == 2
    assert 0.0 <= rep["runs"][0]["acceptance"] <= 1.0
    assert (tmp_path / "eval_pair_cpu_smoke.png").exists()


@pytest.mark.slow  # an experiment script's run; the audit's pieces are test_audit.py's
def test_parity_audit_smoke_with_feature_head_and_trees(tmp_path):
    r = _run("parity_audit.py", "--preset=tiny-qwen3", "--contexts=16", "--ks=1,3",
             "--long_tokens=12", "--near_ties=0", "--tree=2,1", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "parity_audit.json"))
    runs = {k: v for k, v in rep["long_generation"].items() if isinstance(v, dict)}
    assert {"feature head", "feature head, tree 2,1", "self-draft, tree 2,1"} <= set(runs)
    assert all(v["equal"] for v in runs.values()), runs


def test_trace_summarizes_a_device_timeline():
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    ev = [{"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "jspec_matmul",
           "args": {"tf_op": "jit(decode_loop)/while/body/pallas_call"}},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 15, "dur": 5, "name": "loop_add_fusion"},
          {"ph": "X", "pid": 1, "tid": 8, "ts": 15, "dur": 5, "name": "add.1"},  # derived line
          {"ph": "X", "pid": 1, "tid": 7, "ts": 18, "dur": 4, "name": "MemcpyDtoH"}]
    s = trace.summarize(trace.device_events({"traceEvents": meta + ev}), 2, 5)
    assert s["device_events"] == 3 and s["events_per_step"] == 1.5
    assert (s["kernel_us_per_step"], s["busy_us_per_step"], s["span_us_per_step"]) == (9.5, 8.5,
                                                                                       11.0)
    assert s["us_per_step_by_kind"] == {"pallas": 5.0, "xla": 2.5, "copy": 2.0}
    assert s["top"][0]["op"] == "jit(decode_loop)/while/body/pallas_call"
    assert s["idle_gaps"] == [{"before": "jspec_matmul", "after": "loop_add_fusion",
                               "gaps_per_step": 0.5, "us_per_step": 2.5}]
    assert trace.summarize([], 1, 5)["device_events"] == 0


@pytest.mark.slow  # a sweep script
def test_sweep_grouped_smoke(tmp_path):
    r = _run("tuning/sweep_grouped.py", "--interpret", "--preset=tiny-qwen3-moe", "--Ts=1,2",
             "--max_candidates=2", "--iters=1", "--reps=2", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_grouped.json"))
    assert set(rep["weights"]) == {"gate_up", "down"}
    for w in rep["weights"].values():
        assert w["candidates"][0]["config"] == w["rule"] and w["candidates"][0]["sum_us"] > 0
    assert json.load(open(tmp_path / "sweep_grouped_tuned.json")) == rep["tuned"]


@pytest.mark.slow  # a sweep script
def test_sweep_grouped_mxfp4_smoke(tmp_path):
    """--mxfp4: packed candidates (bk a multiple of 32), and a winner is checked against the
    float kernels on the dequantized weights."""
    r = _run("tuning/sweep_grouped.py", "--interpret", "--preset=tiny-gpt-oss", "--mxfp4",
             "--Ts=1,2", "--max_candidates=3", "--iters=1", "--reps=2", "--min_gain=-9",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_grouped.json"))
    assert rep["mxfp4"] and set(rep["weights"]) == {"gate_up", "down"}
    for w in rep["weights"].values():
        assert all(c["config"]["bk"] % 32 == 0 for c in w["candidates"][1:])
        if w["best"] != w["rule"]:
            assert w["packed_equals_dequantized"] is True
    r = _run("tuning/sweep_grouped.py", "--interpret", "--preset=tiny-qwen3-moe", "--mxfp4",
             f"--out={tmp_path}")
    assert r.returncode != 0 and "only gpt-oss presets" in r.stderr


@pytest.mark.slow  # a sweep script
def test_sweep_combine_smoke(tmp_path):
    r = _run("tuning/sweep_combine.py", "--interpret", "--preset=tiny-qwen3-moe", "--Ts=1,3",
             "--max_candidates=3", "--iters=1", "--reps=2", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_combine.json"))
    assert [r["kind"] for r in rep["rows"]] == ["xla", "kernel", "kernel", "kernel"]
    assert rep["rows"][1]["config"] == rep["default"]
    assert all(r["same_bits_as_default"] and r["token_alone_is_its_row"]
               for r in rep["rows"][1:])
    assert rep["best"] is not None and rep["best"]["sum_us"] > 0


@pytest.mark.slow  # a sweep script
def test_sweep_route_smoke(tmp_path):
    r = _run("tuning/sweep_route.py", "--interpret", "--preset=tiny-qwen3-moe", "--Ms=1,3",
             "--max_candidates=2", "--iters=1", "--reps=2", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_route.json"))
    assert [r["kind"] for r in rep["rows"]] == ["xla", "mosaic", "kernel", "kernel"]
    assert rep["rows"][2]["config"] == rep["default"]
    assert all(r["same_bits_as_default"] and r["row_alone_is_its_row"]
               for r in rep["rows"][2:])
    assert rep["rows"][1]["row_alone_is_its_row"] and rep["rows"][1]["ids_equal_triton"]


@pytest.mark.slow  # a profiling script
def test_profile_step_smoke(tmp_path):
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3-moe",
             "--dtype=float32", "--context=16", "--options=moe_layout_kernel=1",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "profile_step_tiny-qwen3-moe.json"))
    assert rep["step_ms"] > 0 and rep["speed_options"]["moe_layout_kernel"] is True
    assert rep["device_events"] == 0  # a CPU trace has no device timeline


@pytest.mark.slow  # a profiling script
def test_profile_step_mxfp4_smoke(tmp_path):
    """--mxfp4_experts: a gpt-oss preset's experts packed; another family is refused."""
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-gpt-oss",
             "--context=16", "--mxfp4_experts", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(tmp_path / "profile_step_tiny-gpt-oss.json"))["step_ms"] > 0
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3-moe",
             "--mxfp4_experts", f"--out={tmp_path}")
    assert r.returncode != 0 and "only gpt-oss presets" in r.stderr


@pytest.mark.slow  # a profiling script: speculative rounds
def test_profile_step_rounds_smoke(tmp_path):
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--dtype=float32",
             "--context=16", "--batch=2", "--round=2", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "profile_step_tiny-qwen3.json"))
    assert rep["step_ms"] > 0 and rep["T"] == 3
    # The default head vocabulary (32,768) is capped at the target's (512 here).
    assert rep["round"] == {"gamma": 2, "draft": "feature head", "head_vocab": 512}
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--dtype=float32",
             "--context=16", "--batch=2", "--decode_round", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    # A later run of the same name never replaces a receipt: it takes the next _run<N>.
    rep = json.load(open(tmp_path / "profile_step_tiny-qwen3_run2.json"))
    assert rep["T"] == 1 and rep["round"]["gamma"] == 0 and rep["step_ms"] > 0
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--dtype=float32",
             "--context=16", "--batch=2", "--serial_loop", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "profile_step_tiny-qwen3_run3.json"))
    assert rep["T"] == 1 and rep["serial_loop"] is True and not rep["round"]
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--serial_loop",
             "--round=2", f"--out={tmp_path}")
    assert r.returncode != 0 and "pick one" in r.stderr
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--dtype=float32",
             "--context=16", "--prefill", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "profile_step_tiny-qwen3_run4.json"))
    assert rep["prefill"] is True and rep["T"] == 16 and rep["steps_traced"] == 1
    r = _run("tuning/profile_step.py", "--interpret", "--preset=tiny-qwen3", "--prefill",
             "--T=4", f"--out={tmp_path}")
    assert r.returncode != 0 and "--T is a step's block" in r.stderr


@pytest.mark.slow  # a timing script: chunks of rounds, then the engine's own chunks
def test_chunk_cost_smoke(tmp_path):
    r = _run("tuning/chunk_cost.py", "--interpret", "--preset=tiny-qwen3", "--layers=0",
             "--dtype=float32", "--batches=2", "--context=16", "--rounds=0,1,2", "--iters=1",
             "--engine_runs=1", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "chunk_cost_tiny-qwen3.json"))
    (b,) = rep["batches"]
    assert set(b["shapes"]) == {"decode", "gamma1", "gamma2", "gamma4"} and b["step_s"] > 0
    assert all(len(s["seconds"]) == 3 and s["s_per_round"] is not None
               for s in b["shapes"].values())
    (run,) = b["engine_runs"]  # each shape's first chunk in the run is not timed
    first = {}
    for name, _, _, timed in run["history"]:
        first.setdefault(name, timed)
    assert first and not any(first.values()), run["history"]
    assert (tmp_path / "chunk_cost_tiny-qwen3.png").exists()


@pytest.mark.slow  # a sweep script
def test_sweep_schedule_smoke(tmp_path):
    r = _run("tuning/sweep_schedule.py", "--interpret", "--preset=tiny-qwen3", "--rows=1,40",
             "--shapes=wo,w_gate_up:glu", "--max_candidates=3", "--iters=1",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_schedule.json"))
    w, g = rep["weights"]
    assert w["weight"] == "wo" and w["base_us"] > 0
    phases = [v["phase"] for v in w["variants"]]  # 3 one-field variants, then crosses
    assert phases[:3] == ["wo"] * 3 and set(phases[3:]) == {"wo combos"}, phases
    assert g["kernel"] == "matmul_glu" and "not fusable" in g["skipped"]  # interpret tiles
    for v in w["variants"]:  # same bk: on CPU every variant keeps the table's bits
        assert v["config"]["bk"] == w["base"]["bk"] and v["bits_equal"] == {"1": True,
                                                                            "40": True}
    assert w["all_bits_equal"] and w["fastest_equal"] is not None


@pytest.mark.slow  # a sweep script
def test_sweep_schedule_tall_writes_its_winners(tmp_path):
    import shutil

    from pallas_kernels.matmul import TUNED_FILE, parse_schedules, read_tuned_file

    table = tmp_path / "tuned.json"
    shutil.copy(TUNED_FILE, table)
    r = _run("tuning/sweep_schedule.py", "--interpret", "--preset=tiny-qwen3", "--tall",
             "--rows=1,80", "--shapes=wo", "--iters=1", "--row_groups=2", f"--write={table}",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_schedule_tall.json"))
    (w,) = rep["weights"]
    assert rep["tier"] == "tall" and rep["timed"] == [160, 320] and rep["bm"] == [64, 128]
    grid = [v for v in w["variants"] if v["phase"] == "wo"]
    assert {v["config"]["bm"] for v in grid} == {64, 128} and len(grid) >= 4
    assert all(v["bits_equal"] == {"1": True, "80": True} for v in w["variants"])
    assert {v["phase"] for v in w["variants"]} == {"wo", "wo stages", "wo row groups"}
    # Row groups: two row tiles a program, the grid's winner at its column tile and half.
    grouped = [v for v in w["variants"] if v["phase"] == "wo row groups"]
    assert grouped and all(v["row_group"] == 2 for v in grouped)
    assert all("row_group" not in v for v in w["variants"] if v["phase"] != "wo row groups")
    data = read_tuned_file(str(table))
    rows = parse_schedules(data["tall_tile"], str(table))
    assert data["multi_tile"] == read_tuned_file()["multi_tile"]  # only the tall table
    best = w["fastest_equal"]
    if best["us"] < w["base_us"]:
        row = rows[(w["K"], w["N"], "bfloat16")]
        assert row["bm"] == best["config"]["bm"]
        assert row.get("row_group") == best.get("row_group")


@pytest.mark.slow  # a sweep script
def test_sweep_schedule_prefill_checks_every_tile_and_writes_only_equal_bits(tmp_path):
    # The prefill tier: PREFILL_GRID's tiles (other K tiles among them) and the schedules
    # such launches run with; in interpret mode a K tile sets bits (XLA sums each block's
    # dot first), so a weight where some tile changed them is never written.
    import shutil

    from pallas_kernels.matmul import TUNED_FILE, read_tuned_file

    table = tmp_path / "tuned.json"
    shutil.copy(TUNED_FILE, table)
    r = _run("tuning/sweep_schedule.py", "--interpret", "--preset=tiny-qwen3", "--prefill",
             "--rows=1,40", "--timed=40", "--shapes=w_down", "--iters=1", f"--write={table}",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_schedule_prefill.json"))
    (w,) = rep["weights"]
    assert rep["tier"] == "prefill" and rep["rows"] == [1, 40]
    assert len({v["config"]["bk"] for v in w["variants"]}) > 1
    assert {v["phase"] for v in w["variants"]} <= {"w_down", "w_down stages"}  # no crosses
    written = {(r["K"], r["N"]) for r in read_tuned_file(str(table)).get("prefill_tile", [])}
    assert ((w["K"], w["N"]) in written) == (
        w["all_bits_equal"] and w["fastest_equal"]["us"] < w["base_us"])


@pytest.mark.slow  # a sweep script
def test_sweep_attention_smoke(tmp_path):
    # Split-KV attention variants (masked V load or select, two stage counts) against
    # the reference config: every variant bitwise equal at decode and verify shapes.
    r = _run("tuning/sweep_attention.py", "--interpret", "--preset=tiny-qwen3", "--context=40",
             "--batches=2", "--warps=4", "--stages=1,2", "--iters=1", "--tag=smoke",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_attention_smoke.json"))
    assert rep["reference"]["v_masked_load"] is False
    got = {(v["config"]["v_masked_load"], v["config"]["num_stages"]) for v in rep["variants"]}
    assert len(rep["variants"]) == 4 and got == {(m, s) for m in (False, True) for s in (1, 2)}
    assert rep["all_bits_equal"] and all(
        set(v["by_shape"]) == {"B2T1", "B2T5"} for v in rep["variants"])


@pytest.mark.slow  # a sweep script
def test_sweep_tree_attention_smoke(tmp_path):
    # Packed tree tiles against one token a tile: no mismatching row, both timed.
    r = _run("tuning/sweep_tree_attention.py", "--interpret", "--presets=tiny-gemma3",
             "--context=40", "--sizes=5", "--time_sizes=5", "--seeds=1", "--iters=1",
             "--tag=smoke", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_tree_attention_smoke.json"))
    assert rep["mismatching_rows"] == {"packed": 0}
    assert sum(r["rows"] for r in rep["parity"]) > 0
    assert set(rep["timing"][0]["us"]) == {"token", "packed", "chain", "decode"}


@pytest.mark.slow  # lowers 253 kernels
def test_dump_triton_ir_smoke(tmp_path):
    # Two runs over the same code give the same IR hashes, and the tree kernel is among
    # the kernels dumped (a refactor's "same device code" check).
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        r = _run("tuning/dump_triton_ir.py", f"--out={out}")
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = ((o / "hashes.txt").read_text() for o in outs)
    assert a == b and "jspec_tree_attention_split" in a and len(a.splitlines()) > 100
    assert "_B1_T1100_" in a  # the prefill tier's launches
    assert "jspec_attention_group_split" in a and "jspec_grouped_matmul_glu" in a
    assert "jspec_moe_layout" in a and "jspec_moe_combine" in a and "jspec_route" in a
    launch = (outs[0] / "launch.txt").read_text().splitlines()  # warps, stages, grid each
    assert [x.split()[0] for x in launch] == [x.split()[0] for x in a.splitlines()]
    assert all(x.split()[1].startswith("warps=") for x in launch)


@pytest.mark.slow  # an experiment script's run; test_row_group proves its option check
def test_bench_kernels_smoke(tmp_path):
    # The kernel benchmark end to end on a tiny model (CPU: host timings, f32): single
    # ops, steps at T = 1 and 2, and option variants checked bitwise: against the default
    # step, or a variant of numerics of its own (attn_split=16) against its first variant.
    r = _run("bench_kernels.py", "--interpret", "--dtype=float32", "--preset=tiny-qwen3",
             "--batches=2", "--gammas=1", "--iters=1", "--context=16",
             "--options=matmul_row_group=1,attn_split=16,attn_split=16+matmul_row_group=1",
             "--tag=smoke", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "bench_kernels_tiny-qwen3_smoke.json"))
    assert {m["timing"] for m in rep["matmuls"]} == {"host"}  # no device timeline on a CPU
    assert all(m["pallas_us"] > 0 and m["xla_us"] > 0 for m in rep["matmuls"])
    steps = {(s["backend"], s["T"]) for s in rep["steps"]}
    variants = ("pallas+matmul_row_group=1", "pallas+attn_split=16",
                "pallas+attn_split=16+matmul_row_group=1")
    assert steps == {(b, t) for b in ("pallas", "xla", *variants) for t in (1, 2)}
    assert rep["options_bits_equal_pallas"] is True
    by = {s["backend"]: s for s in rep["steps"] if s["T"] == 2}
    assert by[variants[0]]["bits_equal_pallas"] is True and "bits_reference" not in by[
        variants[0]]
    assert "max_abs_diff_vs_pallas" in by[variants[1]]
    assert by[variants[2]]["bits_reference"] == variants[1]
    assert by[variants[2]]["bits_equal_pallas"] is True


def test_flag_checks_fail_at_parsing():
    from absl import flags

    from jspec.bench import flag_checks

    def parse(arg):  # fresh flags each time: a failed parse keeps its bad value
        fv = flags.FlagValues()
        flag_checks.require_counts(flags.DEFINE_list("batches", ["1"], "", flag_values=fv),
                                   flags.DEFINE_integer("iters", 3, "", flag_values=fv))
        flag_checks.require_probabilities(flags.DEFINE_list("accept", ["0.8"], "",
                                                            flag_values=fv))
        flag_checks.require_positive(flags.DEFINE_float("lr", 1e-3, "", flag_values=fv))
        flag_checks.require_choices(flags.DEFINE_list("models", ["a"], "", flag_values=fv),
                                    ("a", "b"))
        fv(["prog", arg])

    for good in ("--batches=1,8", "--iters=2", "--accept=0,1", "--lr=0.5", "--models=b,a"):
        parse(good)
    for bad in ("--batches=0", "--batches=a", "--batches=1.5", "--iters=0", "--accept=1.5",
                "--accept=nan", "--lr=0", "--lr=inf", "--models=c", "--models="):
        with pytest.raises(flags.IllegalFlagValueError, match="must"):
            parse(bad)
    r = _run("bench_e2e.py", "--batches=0")  # an entry point: before any model is built
    assert r.returncode != 0 and "--batches=['0']: must hold integers >= 1" in r.stderr


def test_exact_greedy_refuses_sampling_flags_it_would_ignore():
    # exact_greedy does not sample: a top_k / top_p set away from its default is an error
    # (as make_sampler's at temperature 0), and the temperature it ignores is still a number
    # in range; the sampling policies take all three.
    from jspec.cli import policy_of

    assert policy_of("exact_greedy", 0.8) == jspec.ExactGreedy()  # the flag's default
    for kw, words in ((dict(top_p=0.5), "top_p=0.5"), (dict(top_k=7), "top_k=7")):
        with pytest.raises(ValueError, match=words):
            policy_of("exact_greedy", 0.8, **kw)
    with pytest.raises(ValueError, match="temperature=-3"):
        policy_of("exact_greedy", -3.0)
    assert policy_of("gumbel_coupled", 0.8, 7, 0.5) == jspec.GumbelCoupled(0.8, 7, 0.5)


@pytest.mark.parametrize("flags,words", [
    (["--config.temperature=1.5"], ("exact_greedy does not sample", "temperature=1.5")),
    # a temperature out of range is named as such, not as one greedy would ignore
    (["--config.temperature=-1"], ("temperature=-1.0 must be a finite number in [0",)),
    (["--config.tree=2,1", "--config.gamma=7"], ("--config.gamma=7 does not apply with a tree",)),
    (["--config.adaptive=0,1,2", "--config.gamma=3"],  # the header showed gamma=3, unused
     ("--config.gamma=3 does not apply with adaptive shapes",)),
    pytest.param(["--check_parity=False", "--config.check_parity=True"], ("disagree",),
                 marks=pytest.mark.slow),
    pytest.param(["--config.drafter=prompt_lookup", "--config.tree=dynamic:3,8,3"],
                 ("prompt lookup grows static trees only",), marks=pytest.mark.slow),
    pytest.param(["--config.draft_options=bogus"], ("unknown option 'bogus'",),
                 marks=pytest.mark.slow),
    # a prompt byte that is not UTF-8 was the tokenizer's TypeError, as a traceback
    (["--config.prompt=ab\udcff"], ("prompt 1 of 1: the prompt is not valid Unicode text",)),
    pytest.param(["--config.drafter=model", f"--config.draft_head={ROOT}/README.md",
                  "--config.draft_head_size=0"], ("--config.draft_head_size=0: must be",),
                 marks=pytest.mark.slow),
    # "--flag False": absl kept "False" as an argument, dropped it, and the flag stayed on
    (["--config.check_parity", "False"], ("unexpected argument(s) 'False'",)),
    # kernel options for a draft on xla, which reads none (the header said "none")
    pytest.param(["--config.drafter=model", "--config.draft_options=mosaic"],
                 ("sets kernel options, which the draft's xla backend never reads",),
                 marks=pytest.mark.slow)])
def test_speculative_cli_refuses_flags_it_would_drop(flags, words):
    # Each a flag the run would ignore or refuse only after loading: one line, exit 2.
    _one_line_error(_run(*_SPEC, *flags), *words)


def test_text_entry_points_check_seeds_and_timed_runs_before_loading(tmp_path):
    # A bad seed fails before the model loads (it used to surface after loading, and in
    # generate.py after the prompt was printed); bench_prompts' timing_runs=0 is refused,
    # not clipped to 1, and a --config.out that is a file fails before any prompt runs.
    r = _run(*_SPEC, "--config.seed=-1")
    _one_line_error(r, "seed=-1")
    assert "embedded code pair" not in r.stdout
    _one_line_error(_run(*_GEN, "--config.temperature=0.5", "--config.seed=-4"), "seed=-4")
    for flag in ("--config.max_new_tokens=-3", "--config.max_len=-5"):  # were after loading
        r = _run(*_GEN, flag)
        _one_line_error(r, flag.split(".")[1])
        assert "model:" not in r.stdout and "rgb_to_hls" not in r.stdout
    bp = ("bench_prompts.py", f"--config={ROOT}/configs/bench_prompts.py:runlocal")
    _one_line_error(_run(*bp, "--config.timing_runs=0"), "timing_runs=0")
    (tmp_path / "afile").write_text("")
    _one_line_error(_run(*bp, f"--config.out={tmp_path / 'afile'}"), "is a file")


def test_bench_e2e_checks_its_flags_before_building(tmp_path):
    # A misspelled drafter ran the draft model under the wrong label; serial runs without
    # pallas (the oracle's reference) ended in a KeyError; a bad tree was a traceback after
    # the serial runs; so was a prompt whose run outgrew the target's positions (after its
    # serial runs). Now each is one line before any model is built (no receipt).
    for flag, words in (("--drafter=featur", "--drafter=['featur']"),
                        ("--serial_backends=xla", "must hold pallas"),
                        ("--tree=8,8", "--tree: tree '8,8'"),
                        # an empty list: a matplotlib error, or max()'s, after the builds
                        ("--batches=", "--batches=[]: must hold integers >= 1, at least one"),
                        ("--gammas=", "--gammas=[]: must hold integers >= 1, at least one"),
                        ("--prompt_len=131072", "+ the largest verify block (9) = 131129 "
                         "positions exceed --target=tiny-qwen3's max_position_embeddings")):
        _one_line_error(_run("bench_e2e.py", "--nopeers", flag, f"--out={tmp_path}"), *words)
    _one_line_error(_run("bench_e2e.py", "--nopeers", "--drafter=model", "--draft=mistral-7b:1",
                         "--prompt_len=40000", f"--out={tmp_path}"),
                    "exceed --draft=mistral-7b:1's max_position_embeddings (32768)")
    _one_line_error(_run("bench_e2e.py", "--nopeers", "--out=/proc/jspec_out"),
                    "--out='/proc/jspec_out' is not writable")  # was: after the builds
    assert not list(tmp_path.iterdir())


def test_benchmarks_check_their_flags_before_building(tmp_path):
    # bench_moe: a zero roofline bandwidth divided by zero after the measuring; an
    # unknown preset or option string was a traceback; eval_pair: an unknown policy
    # failed after the serial run.
    _one_line_error(_run("bench_moe.py", "--preset=tiny-qwen3-moe", "--peak_TBps=0",
                         f"--out={tmp_path}"), "--peak_TBps=0.0: must be a finite number > 0")
    _one_line_error(_run("bench_context.py", "--preset=tiny-foo", f"--out={tmp_path}"),
                    "--preset='tiny-foo'")
    _one_line_error(_run("bench_context.py", "--preset=tiny-qwen3", "--contexts=200000",
                         f"--out={tmp_path}"), "--contexts=200000 exceeds")
    _one_line_error(_run("eval_pair.py", "--policies=greedy", "--nopeers",
                         f"--out={tmp_path}"), "--policies: unknown verify policy 'greedy'")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flags,words", [
    # a misspelled or empty --drafters ran no speculative run, wrote a receipt, exit 0
    (["--drafters=modle"], ("--drafters=['modle']: must name one or more of",)),
    (["--drafters=oracle", "--accept="], ("--accept is empty, so --drafters=oracle",)),
    # each of these was a traceback, after the serial run (gamma) or every run (--out)
    (["--target=tiny-foo"], ("--target='tiny-foo': not a directory, and 'tiny-foo' is not",)),
    (["--draft=tiny-qwen3:x"], ("--draft='tiny-qwen3:x': the layers after ':'",)),
    (["--backend=plas"], ("--backend='plas': choose from",)),
    (["--gammas=2,40"], ("--gammas=['2', '40']: must hold integers in [1, 32]",)),
    (["--out=/proc/jspec_out"], ("--out='/proc/jspec_out' is not writable",)),
])
def test_bench_speculative_checks_its_flags_before_building(tmp_path, flags, words):
    _one_line_error(_run("bench_speculative.py", f"--out={tmp_path}", *flags), *words)
    assert not list(tmp_path.iterdir())


def test_train_draft_head_checks_its_dtypes_before_training(tmp_path):
    # An export dtype it cannot write was found only at the export, after the training.
    r = _run("train_draft_head.py",
             f"--config={ROOT}/configs/train_draft_head.py:cpu,runlocal",
             f"--config.out_dir={tmp_path / 'head'}", f"--config.workdir={tmp_path / 'w'}",
             "--config.export_dtype=int8")
    _one_line_error(r, "--config.export_dtype: dtype='int8'")
    assert "train head" not in r.stderr and not list(tmp_path.iterdir())
    # An out_dir it cannot write failed at the export, after the training.
    r = _run("train_draft_head.py",
             f"--config={ROOT}/configs/train_draft_head.py:cpu,runlocal",
             "--config.out_dir=/proc/jspec_head", f"--config.workdir={tmp_path / 'w'}")
    _one_line_error(r, "--config.out_dir='/proc/jspec_head' is not writable")
    assert "train head" not in r.stderr and not list(tmp_path.iterdir())


def test_parity_audit_loads_its_head_before_the_controls(tmp_path):
    # A --head that is no EAGLE-3 head failed only after the same-prefix controls ran.
    r = _run("parity_audit.py", "--preset=tiny-qwen3", "--layers=1", "--contexts=8",
             "--ks=1", f"--head={jspec.default_pair()[0]}", f"--out={tmp_path}")
    _one_line_error(r, "an EAGLE-3 head is one of")
    assert "same-prefix controls" not in r.stderr and not list(tmp_path.iterdir())


@pytest.mark.slow  # four scripts run end to end
def test_benchmarks_default_to_interpret_mode_without_a_gpu(tmp_path):
    # Without --interpret on a CPU the kernels failed deep inside JAX ("Only interpret
    # mode is supported on CPU backend"); now the default is interpret mode where there
    # is no GPU, as in jspec.load_hf and random_model.
    r = _run("bench_moe.py", "--preset=tiny-qwen3-moe", "--layers=1", "--context=8",
             "--Ts=1", "--xla_Ts=1", "--iters=1", "--dtype=float32", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(tmp_path / "bench_moe_tiny-qwen3-moe.json"))["complete"]


def test_gpu_session_keeps_a_quoted_value_with_spaces_as_one_step(tmp_path):
    """`gpu_session.sh "GSWEEP_FLAGS=--a=1 --b=2" step`: the variable gets the whole value
    (it was split at the space into a variable and a step that `export` refused)."""
    env = os.environ | {"OUT": str(tmp_path), "GPU": "h200", "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", "experiments/gpu_session.sh", "X_FLAGS=--a=1 --b=2",
                        "no_such_step"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "=== X_FLAGS=--a=1 --b=2\n=== no_such_step\nunknown step no_such_step" in r.stdout
    assert "export" not in r.stderr


@pytest.mark.parametrize("script, flags, words", [
    # each was absl's traceback with exit code 1, gpu_parity's code for failed parity
    ("gpu_parity.py", ["--models=nosuch:2", "--interpret"], ("nosuch",)),
    ("bench_kernels.py", ["--preset=tiny-qwen3", "--dtype=fp16"], ("fp16",)),
    ("tuning/profile_step.py", ["--batch=0"], ("--batch",)),  # a tuning script's own check
    # (was exit 0 after the whole sweep: a variant that did not parse just read False)
    ("tuning/mosaic_prefill.py", ["--configs=garbage"], ("--configs", "'garbage'")),
    # --out is checked before any work in every entry point (the sweep ran, then its
    # receipt could not be written).
    ("tuning/sweep_attention.py", ["--out=README.md"], ("--out='README.md' is a file",)),
])
def test_the_gpu_scripts_name_a_bad_flag_in_one_line(tmp_path, script, flags, words):
    _one_line_error(_run(script, f"--out={tmp_path}", *flags), *words)


def test_every_absl_entry_point_runs_through_cli_run():
    # cli.run turns a bad flag or a refused value into one `error:` line with exit code 2;
    # a script on absl's app.run prints a traceback with exit code 1 instead.
    import glob

    scripts = glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True)
    bare = [os.path.relpath(s, ROOT) for s in scripts if "app.run(" in open(s).read()]
    assert not bare, bare
    assert len([s for s in scripts if "cli.run(main)" in open(s).read()]) >= 20


@pytest.mark.slow  # four entry-point runs; the one-line error path itself: the fast tier's
def test_config_file_and_eval_pair_mistakes_are_one_line(tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text("X = 1\n")
    _one_line_error(_run(_GEN[0], f"--config={bare}"), "the file defines no get_config()")
    _one_line_error(_run(*_GEN, "--config.max_len=100000"),
                    "max_len=100000 exceeds the model's max_position_embeddings (4096)")
    # Checked tokens against serial output and reported a parity failure (exit 1).
    _one_line_error(_run("eval_pair.py", "--policies=rejection_sampling", "--nopeers",
                         f"--out={tmp_path}"), "exact in distribution only")
    _one_line_error(_run("eval_pair.py", "--drafters=model", f"--head={tmp_path}",
                         "--nopeers", f"--out={tmp_path}"),
                    "--head does not apply: only --drafters with feature reads it")

