"""bench/bench_policy_update.py --quick runs end to end, so the policy-update memory benchmark cannot rot.

The quick sizes are far too small for the targets to mean anything; only the structure of the tables and
a few exact byte counts that hold at any size are checked.
"""

from __future__ import annotations

import pytest
from bench_loader import load_bench

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_policy_update.py --quick, in this process


@pytest.fixture(scope="module")
def bench():
    with load_bench("bench_policy_update.py") as module:
        yield module


def _table(text: str, heading: str) -> list[list[str]]:
    """Body rows of the first markdown table after ``heading``, as lists of stripped cells."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    body = []
    for ln in lines[start + 2 :]:  # skip the header and the alignment row
        if not ln.startswith("|"):
            break
        body.append([c.strip() for c in ln.strip("|").split("|")])
    return body


def test_quick_bench_prints_every_table(bench, capsys):
    text = bench.main(["--quick"])
    assert text in capsys.readouterr().out
    assert "Command: `python bench/bench_policy_update.py --quick`" in text

    cfg = bench.parse_args(["--quick"])
    rows_a = _table(text, "### A.")
    assert len(rows_a) == 2 * 2 * len(cfg.vocabs)  # settings x implementations x vocabs
    for setting, vocab, impl, resident, peak, above, _grads, vocab_grad, *_ in rows_a:
        v = int(vocab.replace(",", ""))
        assert float(peak.replace(",", "")) > float(resident.replace(",", "")) > 0
        assert float(above.replace(",", "")) > 0
        # the tied [V, H] weight has a float32 gradient exactly when it is trained
        expected = v * cfg.hidden * 4 / 2**20 if setting == "full-ft" else 0.0
        assert float(vocab_grad.replace(",", "")) == pytest.approx(expected, abs=0.05), (setting, impl)

    rows_b = _table(text, "### B.")
    assert [r[0] for r in rows_b] == ["lit-rl RefCachedGRPO", "lit-rl Intuitor", "full-logits Intuitor"]
    # Intuitor's update is GRPO's update: the same computation allocates the same bytes
    assert rows_b[0][4] == rows_b[1][4]

    targets = _table(text, "### Targets")
    assert len(targets) == 8
    assert all(r[3] in {"yes", "**no**", "—"} for r in targets)


def test_bad_arguments_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "C"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--vocabs", "1000"])
