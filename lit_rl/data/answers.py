r"""Final answers out of completions and reference solutions, and whether two answers are the same.

Three places a final answer is written in the common sets:

- GSM8K (Cobbe et al. 2021, ``openai/gsm8k``): a last line ``#### 42``; the reference solutions end the same way.
- MATH (Hendrycks et al. 2021): the last ``\boxed{...}`` of the solution, braces nested.
- An ``<answer>...</answer>`` tag, as in DeepSeek-R1's template and TRL's GRPO examples.

**Two different answers count as none.** A completion that writes two ``####`` lines, two boxes or two tags with
different contents gets no answer (``None``), so a policy cannot raise its reward by listing candidates; repeating
the same answer is fine.

**Normalisation** follows the steps of the MATH equivalence check (``math_equivalence.py`` in the public
``hendrycks/math`` repository): ``\left``/``\right``, ``^\circ``, ``\$``, ``\%``, thin spaces and spaces go,
``\dfrac``/``\tfrac`` become ``\frac``, ``\frac12`` becomes ``\frac{1}{2}``, a unit in ``\text{...}`` after a value
goes, a short ``x =`` in front goes. Then, unlike that check, two answers that both read as numbers (integers,
decimals, ``a/b``, ``\frac{a}{b}``, thousands commas, a sign) are compared as exact fractions, so ``\frac{1}{2}``,
``1/2`` and ``0.5`` agree. There is no symbolic algebra: ``\sqrt{8}`` and ``2\sqrt{2}`` differ.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_GSM8K_LINE = re.compile(r"####\s*([^\n]*)")
_GSM8K_NUMBER = re.compile(r"-?\$?\s*(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?")
_TAG = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("answer", "think")}


def gsm8k_final(text: str) -> str | None:
    """The number of the ``#### <number>`` line (``$``, thousands commas and a trailing period dropped), as a plain
    decimal string; ``None`` with no such line, no number in it, or two lines that disagree."""
    values = set()
    for line in _GSM8K_LINE.findall(text):
        match = _GSM8K_NUMBER.search(line)
        if match is None:
            continue
        sign = "-" if match.group(0).lstrip().startswith("-") else ""
        values.add(_plain(Fraction(sign + match.group(1).replace(",", "") + (match.group(2) or ""))))
    return values.pop() if len(values) == 1 else None


def boxed_contents(text: str) -> list[str]:
    r"""The contents of every ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed 5``) in ``text``, in order, with
    nested braces kept whole; a box that never closes is left out."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text):
        if match.group(1) is None:  # `\boxed 5`: up to the next space or `$`
            found.append(re.match(r"[^\s$]*", text[match.end() :]).group(0))
            continue
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def last_boxed(text: str) -> str | None:
    r"""The last ``\boxed{...}``'s contents; ``None`` with no box, an empty one, or boxes that disagree."""
    return _one_answer(boxed_contents(text))


def tagged(text: str, tag: str = "answer") -> str | None:
    r"""The contents of ``<tag>...</tag>`` (a ``\boxed{}`` inside unwrapped); ``None`` with no tag, an empty one, or
    tags that disagree."""
    pattern = _TAG.get(tag) or re.compile(rf"<{tag}>(.*?)</{tag}>", re.S)
    contents = [last_boxed(c) or c for c in pattern.findall(text) if c.strip()]
    return _one_answer(contents)


def reference_answer(answer: Any) -> str | None:
    r"""The final answer of a reference: a GSM8K solution (``... #### 42``), a MATH solution (its last ``\boxed``), or
    the answer itself (``42``, ``\frac{1}{2}``)."""
    if answer is None:
        return None
    text = str(answer).strip()
    if "####" in text:
        return gsm8k_final(text)
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed(text)
    return text or None


def same_answer(given: str | None, reference: str | None) -> bool:
    """Whether two final answers agree after :func:`normalize` (as numbers when both read as one)."""
    if given is None or reference is None:
        return False
    a, b = normalize(given), normalize(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


def normalize(answer: str) -> str:
    r"""A canonical form of a LaTeX answer (see the module docstring); ``\frac{1}{2}`` stays a fraction."""
    s = answer.strip()
    for old, new in (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\left", ""), ("\\right", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""),
                     ("\\$", ""), ("$", ""), ("\\%", ""), ("%", "")):  # fmt: skip
        s = s.replace(old, new)
    whole_text = re.fullmatch(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", s.strip())
    if whole_text:  # `\text{Monday}` is the answer itself
        s = whole_text.group(1)
    else:  # `10\text{ cm}`: the unit after a value goes
        s = re.sub(r"\\(?:text|mbox|mathrm)\{[^{}]*\}", "", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)  # \frac1{2}
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"^[A-Za-z](?:_\w)?=(?!=)", "", s)  # `x=5`, `k_1=5`
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    return s


_DECIMAL = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"


def as_number(answer: str) -> Fraction | None:
    r"""The exact value of a normalised answer that is a number: ``42``, ``-0.5``, ``1/2``, ``\frac{-1}{2}``,
    ``-\frac{3}{4}``; ``None`` for anything else."""
    if re.fullmatch(_DECIMAL, answer):
        return Fraction(answer)
    match = re.fullmatch(rf"(-?)(?:({_DECIMAL})/({_DECIMAL})|\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}})", answer)
    if match is None:
        return None
    num, den = (match.group(2), match.group(3)) if match.group(2) else (match.group(4), match.group(5))
    if Fraction(den) == 0:
        return None
    value = Fraction(num) / Fraction(den)
    return -value if match.group(1) else value


def _one_answer(contents: list[str]) -> str | None:
    """The answer when every non-empty candidate agrees; ``None`` for none, an empty last one, or a disagreement."""
    if not contents or not normalize(contents[-1]):
        return None
    last = contents[-1]
    agree = all(same_answer(c, last) for c in contents if normalize(c))
    return last.strip() if agree else None


def _plain(value: Fraction) -> str:
    """``42`` for an integer, else the decimal (``1234.5``): a GSM8K answer was written as a decimal."""
    return str(value.numerator) if value.denominator == 1 else repr(float(value))
