r"""The answer-extracting rewards on real-looking completions: GSM8K's `####` line, MATH's last `\boxed{}`, an
`<answer>` tag, the `<think>/<answer>` format; each table holds the cases that must score 0 beside those that score 1."""

from __future__ import annotations

import pytest

from lit_rl.data.answers import as_number, boxed_contents, gsm8k_final, normalize, reference_answer
from lit_rl.data.rewards import boxed_answer, gsm8k_answer, tagged_answer, think_answer_format

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April "
    "and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_SOLUTION, 1.0),
        ("48 + 24 = 72\n#### 72.", GSM8K_SOLUTION, 1.0),  # trailing period
        ("The total is $1,234.\n#### $1,234", "#### 1234", 1.0),  # dollar sign and thousands comma
        ("#### 1,234,567", "1234567", 1.0),  # a bare reference (verl's ground_truth)
        ("The change is 0.50 dollars.\n#### 0.5", "#### 0.50", 1.0),
        ("He is 5 years younger.\n#### -5", "...\n#### -5", 1.0),  # negative
        ("#### 18 dollars", "#### 18", 1.0),  # a unit after the number
        ("72\n#### 72\nSo the answer is 72.\n#### 72", GSM8K_SOLUTION, 1.0),  # the same answer twice
        ("She sold 72 clips altogether.", GSM8K_SOLUTION, 0.0),  # no #### line
        ("#### 71", GSM8K_SOLUTION, 0.0),  # wrong number
        ("#### 72\n#### 73", GSM8K_SOLUTION, 0.0),  # two answers that disagree
        ("####", GSM8K_SOLUTION, 0.0),  # an empty answer line
        ("#### seventy-two", GSM8K_SOLUTION, 0.0),  # no number
        ("#### 1,234", "#### 1234.5", 0.0),
        ("#### 72", None, 0.0),  # no reference
    ],
)
def test_gsm8k_answer(completion, answer, expected):
    assert gsm8k_answer([completion], [answer]) == [expected]


def test_gsm8k_reference_is_read_from_the_solution():
    assert gsm8k_final(GSM8K_SOLUTION) == "72"
    assert gsm8k_final("#### $1,234.50.") == "1234.5"
    assert reference_answer(GSM8K_SOLUTION) == "72" and reference_answer(72) == "72"


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"So the probability is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
        (r"$\boxed{\dfrac{1}{2}}$", r"\frac12", 1.0),  # \dfrac and the short \frac12
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),  # a decimal against a fraction
        (r"$\boxed{1/2}$", r"The answer is $\boxed{\frac{1}{2}}$.", 1.0),  # a MATH solution as the reference
        (r"$\boxed{-\frac{3}{4}}$", r"\frac{-3}{4}", 1.0),  # negative fractions
        (r"$\boxed{-7}$", "-7", 1.0),
        (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"\left(3,\frac{\pi}{2}\right)", 1.0),  # \left( \right)
        (r"$\boxed{90^\circ}$", "90", 1.0),  # degrees
        (r"The angle is $\boxed{45^{\circ}}$", r"45", 1.0),
        (r"$\boxed{10\text{ cm}}$", "10", 1.0),  # a unit in \text
        (r"$\boxed{\text{Monday}}$", r"\text{Monday}", 1.0),  # text as the answer itself
        (r"$\boxed{x = 5}$", "5", 1.0),  # a leading variable
        (r"$\boxed{1,\!000}$", "1000", 1.0),  # thousands separator with a thin space
        (r"$\boxed{50\%}$", "50", 1.0),
        (r"$\boxed{\$18.90}$", "18.9", 1.0),
        (r"$\boxed{\sqrt{2}}$", r"\sqrt2", 1.0),
        (r"$\boxed{{a}^{2}+\frac{1}{x}}$", r"{a}^{2}+\frac{1}{x}", 1.0),  # nested braces kept whole
        (r"First $\boxed{3}$, checking again: $\boxed{3}$.", "3", 1.0),  # the same answer twice
        (r"$\boxed 5$", "5", 1.0),  # \boxed without braces
        (r"The answer is $\frac{1}{2}$.", r"\frac{1}{2}", 0.0),  # no box
        (r"$\boxed{}$", r"\frac{1}{2}", 0.0),  # an empty box
        (r"$\boxed{ }$", "0", 0.0),  # a blank box is no answer, not zero
        (r"$\boxed{\frac{1}{3}}$", r"\frac{1}{2}", 0.0),  # wrong
        (r"$\boxed{0.33}$", r"\frac{1}{3}", 0.0),  # close is not equal
        (r"It is $\boxed{3}$ or $\boxed{4}$.", "4", 0.0),  # two answers that disagree
        (r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}", 0.0),  # no symbolic algebra
        (r"$\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # never closed
        (r"$\boxed{5}$", "", 0.0),  # no reference
    ],
)
def test_boxed_answer(completion, answer, expected):
    assert boxed_answer([completion], [answer]) == [expected]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{a{b}c} and \boxed{\frac{1}{2}}", ["a{b}c", r"\frac{1}{2}"]),
        (r"\fbox{7}", ["7"]),
        ("no box", []),
    ],
)
def test_boxed_contents(text, expected):
    assert boxed_contents(text) == expected


@pytest.mark.parametrize(
    ("answer", "normal", "number"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}", 0.5),
        (r"\left( 1, 2 \right)", "(1,2)", None),
        ("1,234", "1234", 1234),
        (".5", "0.5", 0.5),
        (r"-\frac{3}{4}", r"-\frac{3}{4}", -0.75),
        ("3/0", "3/0", None),
        (r"k = 12.", "12", 12),
    ],
)
def test_normalize_and_as_number(answer, normal, number):
    assert normalize(answer) == normal
    value = as_number(normal)
    assert (value is None and number is None) or float(value) == number


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("<think>48 + 24 = 72</think>\n<answer>72</answer>", GSM8K_SOLUTION, 1.0),
        ("<think>half</think><answer> \\frac{1}{2} </answer>", "0.5", 1.0),
        ("<think>...</think><answer>\\boxed{-3}</answer>", "-3", 1.0),  # a box inside the tag
        ("<answer>72</answer>", "72", 1.0),  # the format is think_answer_format's job
        ("<think>72</think> The answer is 72.", "72", 0.0),  # no tag
        ("<answer></answer>", "72", 0.0),  # empty
        ("<answer>71</answer>", "72", 0.0),  # wrong
        ("<answer>72</answer><answer>73</answer>", "72", 0.0),  # two answers that disagree
        ("<answer>72", "72", 0.0),  # never closed
    ],
)
def test_tagged_answer(completion, answer, expected):
    assert tagged_answer([completion], [answer]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>\n48 + 24 = 72\n</think>\n<answer>\n72\n</answer>", 1.0),  # TRL's example layout
        ("<think>short</think><answer>72</answer>\n", 1.0),
        ("<think>a</think>\n\n<answer>b</answer>", 1.0),
        ("<answer>72</answer>", 0.0),  # no thinking
        ("<think>72</think>", 0.0),  # no answer
        ("<answer>72</answer><think>why</think>", 0.0),  # the wrong order
        ("Sure! <think>a</think><answer>b</answer>", 0.0),  # text before
        ("<think>a</think><answer>b</answer> Hope this helps.", 0.0),  # text after
        ("<think> </think><answer>b</answer>", 0.0),  # empty thinking
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),  # two answers
        ("<think>a<think>b</think><answer>c</answer>", 0.0),  # a tag twice
    ],
)
def test_think_answer_format(completion, expected):
    assert think_answer_format([completion]) == [expected]


def test_the_rewards_score_a_batch():
    completions = ["#### 72", "#### 3", "no answer"]
    assert gsm8k_answer(completions, [GSM8K_SOLUTION, "4", "1"]) == [1.0, 0.0, 0.0]
