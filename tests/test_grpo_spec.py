"""`fsdpjob validate` on GRPO specs (train.method grpo): the reward functions are checked on the login node (the
file exists, the module loads without torch, the function takes TRL's keywords with the records' fields), a prompt
that leaves no room for grpo.max_new_tokens is refused at its line, num_generations must divide the completions
per rank; each bad input is one line and exit 2, and good specs pass."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import helpers
import pytest

from fsdpjob.orchestrator.core.inputs.rewardfns import LOGIN_FORBIDDEN, load_function, signature_problem

fsdpjob = partial(helpers.fsdpjob, timeout_s=60)
GOOD_REWARDS = '''
def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [1.0 if len(c) < 20 else 0.0 for c in completions]
'''
SPEC = """name: g
profile: local
model:
  path: model
data:
  path: data.jsonl
  seq_len: {seq_len}
train:
  method: grpo
  max_steps: 5
  micro_batch_size: 4
grpo:
  num_generations: {num_generations}
  max_new_tokens: {max_new_tokens}
  reward:
    - rewards.py:exact
    - function: rewards.py:short
      weight: 0.5
"""


def job(tmp_path: Path, rewards: str = GOOD_REWARDS, rows: list | None = None, *, seq_len: int = 128,
        num_generations: int = 4, max_new_tokens: int = 32) -> Path:
    if not (tmp_path / "model").exists():
        helpers.tiny_model_folder(tmp_path / "model")
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC.format(seq_len=seq_len, num_generations=num_generations, max_new_tokens=max_new_tokens))
    rows = rows if rows is not None else [{"prompt": "What is 1+1?", "answer": "2"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(rewards)
    return spec


refused = helpers.refused_at_validate


def test_good_spec_validates(tmp_path):
    job(tmp_path)
    done = fsdpjob("validate", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0 and ": ok (profile local" in done.stdout, done.stderr


def test_chat_prompts_and_a_module_function_validate(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}]
    spec = job(tmp_path, rows=rows)
    (tmp_path / "mathrewards.py").write_text(GOOD_REWARDS)  # cwd: on the Python path of `python -m`
    spec.write_text(spec.read_text().replace("rewards.py:short", "mathrewards:short"))
    done = fsdpjob("validate", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_missing_reward_file_is_refused_at_its_line(tmp_path):
    job(tmp_path)
    (tmp_path / "rewards.py").unlink()
    assert refused(tmp_path) == (f"job.yaml:16: grpo.reward.0: {tmp_path / 'rewards.py'}:exact: the file does not "
                                 "exist; give path/to/file.py:function, relative to the spec file")


def test_a_reward_path_that_is_a_folder_is_refused_as_a_folder(tmp_path):
    job(tmp_path)
    (tmp_path / "rewards.py").unlink()
    (tmp_path / "rewards.py").mkdir()
    (tmp_path / "rewards.py" / "exact.py").write_text(GOOD_REWARDS)
    assert refused(tmp_path) == (f"job.yaml:16: grpo.reward.0: {tmp_path / 'rewards.py'}:exact: is a folder (it "
                                 "holds exact.py), not a .py file; give path/to/file.py:function, the file that "
                                 "defines the function")


def test_a_function_that_does_not_take_a_field_is_refused_naming_the_field(tmp_path):
    job(tmp_path, GOOD_REWARDS.replace("answer, **kwargs", "answer"), rows=[{"prompt": "1+1?", "answer": "2",
                                                                              "level": 1}])
    assert refused(tmp_path) == (
        f"job.yaml:16: grpo.reward.0: {tmp_path / 'rewards.py'}:exact: does not take the records' field 'level' "
        "(called as fn(prompts=..., completions=..., answer=..., level=...), TRL's convention); add a parameter "
        "level or **kwargs")


def test_a_field_that_cannot_be_a_parameter_name_is_read_from_kwargs(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2", "final-answer": "2"}]
    job(tmp_path, GOOD_REWARDS.replace("answer, **kwargs", "answer"), rows=rows)
    assert refused(tmp_path) == (
        f"job.yaml:16: grpo.reward.0: {tmp_path / 'rewards.py'}:exact: does not take the records' field "
        "'final-answer' (called as fn(prompts=..., completions=..., answer=..., final-answer=...), TRL's "
        "convention), which cannot be a parameter's name: take **kwargs and read kwargs['final-answer'] (or rename "
        "the field)")
    job(tmp_path, GOOD_REWARDS.replace("zip(completions, answer)", "zip(completions, kwargs['final-answer'])"),
        rows=rows)
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0


def test_a_function_that_needs_another_argument_is_refused(tmp_path):
    job(tmp_path, GOOD_REWARDS.replace("def short(completions, **kwargs)",
                                       "def short(prompts, completions, answer, target)"))
    said = refused(tmp_path)
    assert said.startswith("job.yaml:17: grpo.reward.1: ") and "needs an argument 'target'" in said, said


def test_a_missing_function_and_a_raising_module_are_named(tmp_path):
    job(tmp_path, GOOD_REWARDS.replace("def short", "def shorter"))
    said = refused(tmp_path)
    assert said.endswith("rewards.py has no 'short' (it defines exact, shorter); fix the name after the colon"), said
    job(tmp_path, "raise RuntimeError('no config here')\n" + GOOD_REWARDS)
    said = refused(tmp_path)  # one line: both functions are of the module that failed
    assert said.endswith("exact: importing rewards.py raised RuntimeError: no config here"), said


@pytest.mark.parametrize("package", LOGIN_FORBIDDEN)
def test_a_module_importing_torch_is_refused(tmp_path, package):
    job(tmp_path, f"import {package}\n" + GOOD_REWARDS)
    said = refused(tmp_path)
    assert said == (f"job.yaml:16: grpo.reward.0: {tmp_path / 'rewards.py'}:exact: rewards.py imports {package} when "
                    "it loads; reward functions must load on the login node without torch (validate imports them "
                    "there): import it inside the function, which runs on the workers only")


def test_torch_imported_inside_the_function_is_fine(tmp_path):
    job(tmp_path, GOOD_REWARDS.replace("    return [float", "    import torch  # noqa\n    return [float"))
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0


def test_the_torch_check_holds_where_torch_is_loaded_already(tmp_path):
    """In a process that has torch (a test run) the module is loaded with torch hidden, and torch is back after."""
    (tmp_path / "r.py").write_text("import torch.nn\ndef f(prompts, completions, **kw):\n    return []\n")
    code = ("import sys, torch\nfrom fsdpjob.orchestrator.core.inputs.rewardfns import *\n"
            f"try:\n    load_function({str(tmp_path / 'r.py:f')!r}, forbid=LOGIN_FORBIDDEN)\n"
            "except RewardLoadError as e:\n    print(e)\n"
            "assert sys.modules['torch'] is torch and 'torch.nn' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "r.py imports torch when it loads" in done.stdout, done.stderr


def test_a_record_field_named_like_a_keyword_is_refused(tmp_path):
    job(tmp_path, rows=[{"prompt": "1+1?", "completions": "2", "answer": "2"}])
    said = refused(tmp_path)
    assert said == ("job.yaml:6: data.path: the records have a field 'completions', but the reward functions get "
                    "the completions in that keyword (TRL's convention); rename the field")


def test_num_generations_not_dividing_the_batch_is_refused(tmp_path):
    job(tmp_path, num_generations=3)
    assert refused(tmp_path) == ("job.yaml:13: grpo.num_generations: 3 completions per prompt do not divide the 4 "
                                 "completions each rank trains per step (train.micro_batch_size x grad_accum_steps); "
                                 "make it a multiple")


def _word_tokenizer(model: Path, words: list[str]) -> None:
    """A word-level tokenizer.json (one token per word) with a bos token: exact counts for the room check."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))


def test_a_prompt_longer_than_seq_len_less_max_new_tokens_is_refused_at_its_line(tmp_path):
    rows = [{"prompt": "one two", "answer": "2"}, {"prompt": " ".join(["one"] * 20), "answer": "3"}]
    job(tmp_path, rows=rows, seq_len=40, max_new_tokens=20)
    _word_tokenizer(tmp_path / "model", ["one", "two"])
    # 20 words and the bos: 21 tokens, one more than the 40 - 20 left for the prompt.
    assert refused(tmp_path) == (f"{tmp_path / 'data.jsonl'}:2: the prompt (field 'prompt', data.prompt_field) is 21 "
                                 "tokens, more than the 20 that data.seq_len 40 leaves beside grpo.max_new_tokens "
                                 "20; raise data.seq_len to at least 41, lower grpo.max_new_tokens or shorten the "
                                 "prompt")
    job(tmp_path, rows=rows, seq_len=41, max_new_tokens=20)
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    chat = [{"prompt": [{"role": "user", "content": " ".join(["two"] * 30)}], "answer": "1"}]
    job(tmp_path, rows=chat, seq_len=41, max_new_tokens=20)
    assert "is at least 30 tokens (its messages' contents alone)" in refused(tmp_path)


def test_no_file_checks_skips_the_reward_functions(tmp_path):
    job(tmp_path, "import torch\n")
    assert fsdpjob("validate", "job.yaml", "--no-file-checks", cwd=tmp_path).returncode == 0


def test_signature_problem_reads_keyword_only_and_positional_only_parameters():
    def kw_only(*, prompts, completions, answer=None):
        return []

    def pos_only(prompts, completions, /, **kwargs):
        return []

    assert signature_problem(kw_only, ["answer"]) is None
    assert "does not take the records' field 'level'" in signature_problem(kw_only, ["answer", "level"])
    assert "does not take the keyword 'prompts'" not in (signature_problem(pos_only, []) or "")
    assert "needs an argument 'prompts'" in signature_problem(pos_only, [])
    assert signature_problem(len, []) is not None or True  # builtins: checked at their first call
    assert load_function("os.path:join") is __import__("os").path.join


def test_the_grpo_example_validates_with_its_reward_functions(tmp_path):
    """examples/grpo-math.yaml with file checks: its reward functions load without torch and take its records'
    fields (test_examples.py validates it without file checks, like every example)."""
    model = helpers.tiny_model_folder(tmp_path / "model")
    done = fsdpjob("validate", "examples/grpo-math.yaml", "--set", f"model.path={model}")
    assert done.returncode == 0, done.stderr


def test_init_method_grpo_writes_a_spec_prompts_and_rewards_that_validate(tmp_path):
    model = helpers.tiny_model_folder(tmp_path / "model")
    done = fsdpjob("init", str(model), "--method", "grpo", "--out", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    text = (tmp_path / "job.yaml").read_text()
    assert "method: grpo" in text and "\ngrpo:\n" in text and "rewards.py:exact_answer" in text, text
    assert '"answer": "' in (tmp_path / "data.jsonl").read_text()
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    # The rewards score as they say (no torch needed to import them).
    fns = {n: load_function(f"{tmp_path / 'rewards.py'}:{n}", forbid=LOGIN_FORBIDDEN)
           for n in ("exact_answer", "format_reward")}
    completions = ["<answer>19</answer>", "It is 19", "<answer>18</answer>", [{"role": "assistant",
                                                                               "content": "7+12 is 19"}]]
    assert fns["exact_answer"](prompts=["q"] * 4, completions=completions, answer=["19"] * 4) == [1.0, 1.0, 0.0, 1.0]
    assert fns["format_reward"](completions=completions) == [1.0, 0.0, 1.0, 0.0]
    # A second init beside them keeps both files and says so.
    again = fsdpjob("init", str(model), "--method", "grpo", "--out", "two.yaml", cwd=tmp_path)
    assert again.returncode == 0 and "rewards.py existed and was kept" in again.stderr, again.stderr


def _colocate(tmp_path, generator: str) -> Path:
    spec = job(tmp_path)
    spec.write_text(spec.read_text() + f"  generator: {generator}\n")
    return spec


def test_colocate_options_a_server_has_are_refused_each_with_its_fix(tmp_path):
    for generator, line in (
            ("{backend: inprocess, mode: colocate}", "grpo.generator.mode: colocate is a mode of vLLM's engine, not "
                                                     "of backend inprocess; set backend: vllm, or drop mode"),
            ("{backend: vllm, mode: colocate, tensor_parallel_size: 2}",
             "grpo.generator.tensor_parallel_size: a colocated engine runs on its training rank's own device: "
             "tensor_parallel_size must be 1; use mode: server for a model that needs tensor parallelism"),
            ("{backend: vllm, mode: colocate, nodes: 2}", "grpo.generator.nodes: nodes is a generation server's; a "
                                                          "colocated engine runs inside the training ranks (mode: "
                                                          "colocate): drop it")):
        _colocate(tmp_path, generator)
        said = refused(tmp_path)
        assert said.startswith("job.yaml:") and said.split(": ", 1)[1] == line, said


def test_colocate_without_vllm_in_the_workers_interpreter_is_refused(tmp_path):
    """The launch's own interpreter (this venv: no vLLM) would run the workers; a generator.python that is not
    there is refused too; an existing one validates (the worker checks its vLLM at set-up)."""
    _colocate(tmp_path, "{backend: vllm, mode: colocate}")
    said = refused(tmp_path)
    assert said.endswith(f"grpo.generator.python: mode colocate runs vLLM inside the training workers, but their "
                         f"interpreter ({sys.executable}) has no vllm; set grpo.generator.python to an environment "
                         "with vLLM and fsdpjob (docs/grpo.md, colocate)"), said
    _colocate(tmp_path, f"{{backend: vllm, mode: colocate, python: {tmp_path / 'none' / 'python'}}}")
    assert refused(tmp_path).endswith(f"{tmp_path / 'none' / 'python'} does not exist; give the python of an "
                                      "environment with vLLM and fsdpjob")
    _colocate(tmp_path, f"{{backend: vllm, mode: colocate, python: {sys.executable}}}")
    done = fsdpjob("validate", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
