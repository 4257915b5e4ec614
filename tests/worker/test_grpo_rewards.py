"""GRPO's reward functions on the worker (jobs/grpo/rewards.py): loaded from a file or a module, called with TRL's
keywords (completions as text or as assistant messages, each record field as a list), the weighted total and each
function's rewards; a function that raises, returns another count, a non-number or a non-finite value is a
RewardError naming the function, the record and what it returned; None is "not applicable"."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fsdpjob.jobs.grpo.rewards import RewardError, RewardFunctions, Scores
from fsdpjob.orchestrator.core.jobspec.methods import RewardFunctionSpec

REWARDS = '''
CALLS = []


def exact(prompts, completions, answer, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answer)]


def length(completions, **kwargs):
    return [len(c if isinstance(c, str) else c[0]["content"]) for c in completions]


def answer_only(completions, answer, **kwargs):
    return [None if a is None else True for a in answer]
'''
PROMPTS = ["What is 1+1?", "What is 2+2?"]


@pytest.fixture()
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def load(path: Path, *names_weights: tuple[str, float]) -> RewardFunctions:
    return RewardFunctions.load([RewardFunctionSpec(function=f"{path}:{n}", weight=w) for n, w in names_weights])


def test_scores_are_the_weighted_sum_with_each_function_apart(rewards_file):
    fns = load(rewards_file, ("exact", 2.0), ("length", 0.5))
    scores = fns.score([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, ["2", "3", " 4", "four"],
                       [{"answer": "2"}] * 2 + [{"answer": "4"}] * 2)
    assert isinstance(scores, Scores) and fns.names == ["exact", "length"]
    assert fns.functions[0].__globals__ is fns.functions[1].__globals__  # one file, loaded once
    assert scores.total.dtype == torch.float32 and scores.total.shape == (4,)
    assert scores.per_function["exact"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.per_function["length"].tolist() == [1.0, 1.0, 2.0, 4.0]
    assert scores.total.tolist() == [2.5, 0.5, 3.0, 2.0]


def test_functions_get_trl_keywords_and_chat_completions_as_messages(rewards_file):
    fns = load(rewards_file, ("exact", 1.0))
    chat = [{"role": "user", "content": "What is 1+1?"}]
    scores = fns.score([PROMPTS[0], chat], ["2", "2"], [{"answer": "2", "level": 1}, {"answer": "2", "level": 2}])
    module = fns.functions[0].__globals__
    (call,) = module["CALLS"]
    assert call == {"prompts": [PROMPTS[0], chat], "completions": ["2", [{"role": "assistant", "content": "2"}]],
                    "answer": ["2", "2"], "level": [1, 2]}
    assert scores.total.tolist() == [1.0, 1.0]


def test_a_module_function_loads(tmp_path, monkeypatch, rewards_file):
    monkeypatch.syspath_prepend(str(tmp_path))
    fns = RewardFunctions.load([RewardFunctionSpec(function="rewards:length")])
    assert fns.score(["p"], ["abc"], [{}]).total.tolist() == [3.0]


def test_none_is_not_applicable_and_all_none_is_an_error(rewards_file):
    fns = load(rewards_file, ("answer_only", 1.0), ("length", 1.0))
    scores = fns.score(["p", "q"], ["ab", "abc"], [{"answer": None}, {"answer": "x"}])
    assert math.isnan(scores.per_function["answer_only"][0]) and scores.per_function["answer_only"][1] == 1.0
    assert scores.total.tolist() == [2.0, 4.0]  # bool True counts 1; None adds nothing
    alone = load(rewards_file, ("answer_only", 1.0))
    with pytest.raises(RewardError, match=r"every reward function returned None \(not applicable\) for completion 0 "
                                          r"of record 7 \(data.jsonl:9\), prompt 'p'"):
        alone.score(["p"], ["ab"], [{"answer": None}], rows=[7], places=[f"data.jsonl:{i + 2}" for i in range(8)])


def bad(tmp_path: Path, body: str) -> RewardFunctions:
    path = tmp_path / "bad.py"
    path.write_text(f"def f(prompts, completions, **kwargs):\n    {body}\n")
    return load(path, ("f", 1.0))


def test_a_raising_function_is_named_with_the_record(tmp_path):
    fns = bad(tmp_path, "raise KeyError('answer')")
    with pytest.raises(RewardError) as caught:
        fns.score(["What is " + "very " * 30 + "long?"], ["2"], [{}], rows=[3])
    said = str(caught.value)
    assert said.startswith(f"reward function {tmp_path / 'bad.py'}:f raised KeyError: 'answer' (on 1 completions, "
                           "the first of record 3, prompt 'What is very very"), said
    assert said.endswith("...')") and len(said) < 300, said


@pytest.mark.parametrize(("body", "words"), [
    ("return [1.0]", "returned 1 values for 2 completions (the first of record 0, prompt 'a'); return one number per "
                     "completion"),
    ("return 1.0", "returned 1.0 (float), not a list of one number per completion"),
    ("return 'ok'", "returned 'ok' (str), not a list"),
    ("return [1.0, 'two']", "returned 'two' (str) for completion 1 of record 1, prompt 'b': not a number"),
    ("return [1.0, float('nan')]", "returned nan for completion 1 of record 1, prompt 'b': rewards must be finite"),
    ("return [float('inf'), 0]", "returned inf for completion 0 of record 0, prompt 'a': rewards must be finite"),
])
def test_bad_answers_are_errors_never_zeros(tmp_path, body, words):
    fns = bad(tmp_path, body)
    with pytest.raises(RewardError) as caught:
        fns.score(["a", "b"], ["x", "y"], [{}, {}])
    assert str(caught.value).startswith(f"reward function {tmp_path / 'bad.py'}:f ")
    assert words in str(caught.value), str(caught.value)


def test_tensors_and_numpy_values_count_as_numbers(tmp_path):
    fns = bad(tmp_path, "import torch; return torch.tensor([0.5, 1.5])")
    assert fns.score(["a", "b"], ["x", "y"], [{}, {}]).total.tolist() == [0.5, 1.5]


def test_a_function_that_cannot_load_or_take_a_field_is_named(tmp_path, rewards_file):
    with pytest.raises(RewardError, match="reward function .*rewards.py:nope: rewards.py has no 'nope'"):
        load(rewards_file, ("nope", 1.0))
    with pytest.raises(RewardError, match="does not exist"):
        load(tmp_path / "missing.py", ("f", 1.0))
    fns = bad(tmp_path, "return []")
    fns.check_fields(["answer"])  # **kwargs takes anything
    strict = load(rewards_file, ("exact", 1.0), ("length", 1.0))
    strict.check_fields(["answer"])
    with pytest.raises(RewardError, match="the records have a field 'prompts'"):
        strict.check_fields(["prompts"])
    (tmp_path / "narrow.py").write_text("def g(prompts, completions):\n    return [0.0] * len(prompts)\n")
    with pytest.raises(RewardError, match=r"narrow.py:g: does not take the records' field 'answer'"):
        load(tmp_path / "narrow.py", ("g", 1.0)).check_fields(["answer"])
