"""benchmarks/humaneval.py: problem selection, code extraction and the checker (no engine)."""

import os

import pytest

from benchmarks import humaneval

PROBLEM = {
    "task_id": "Test/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_select_is_a_fixed_evenly_spaced_subset_of_the_package_problems():
    problems = humaneval.read_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    chosen = humaneval.select(problems, "20")
    assert [p["task_id"] for p in chosen[:3]] == ["HumanEval/0", "HumanEval/8", "HumanEval/16"]
    assert len({p["task_id"] for p in chosen}) == 20
    assert humaneval.select(problems, "all") == problems
    with pytest.raises(ValueError, match="--problems"):
        humaneval.select(problems, "0")


def test_user_turn_holds_the_instruction_and_the_problem_prompt():
    turn = humaneval.user_turn(PROBLEM)
    assert turn.startswith(humaneval.INSTRUCTION) and PROBLEM["prompt"] in turn


@pytest.mark.parametrize(
    "reply, passed",
    [
        ("Here it is:\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\nDone.", True),
        ("```python\ndef add(a, b):\n    return a - b\n```", False),  # wrong
        ("```\nimport math\n\ndef add(a, b):\n    return int(math.fsum([a, b]))\n```", True),  # no language tag
        ("    return a + b\n", True),  # a bare body continues the stub
        ("```python\ndef add(a, b):\n    return a +", False),  # cut off by max_tokens: a syntax error
    ],
)
def test_check_runs_the_extracted_code_against_the_tests(reply, passed):
    result = humaneval.check([PROBLEM], {("m", "Test/0"): reply}, timeout_s=5.0)[("m", "Test/0")]
    assert result["passed"] is passed, result


def test_a_hanging_program_times_out_in_a_child_process():
    reply = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    result = humaneval.check([PROBLEM], {("m", "Test/0"): reply}, timeout_s=1.0)[("m", "Test/0")]
    assert result == {**result, "passed": False, "result": "timed out"}


def test_generated_code_never_runs_in_the_benchmark_process(tmp_path):
    marker = tmp_path / "pid"
    reply = f"```python\nimport os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ndef add(a, b):\n    return a + b\n```"
    assert humaneval.check([PROBLEM], {("m", "Test/0"): reply}, timeout_s=5.0)[("m", "Test/0")]["passed"]
    assert int(marker.read_text()) != os.getpid()
