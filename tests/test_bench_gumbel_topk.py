"""bench/bench_gumbel_topk.py --quick runs end to end in a subprocess, so the GumbelTopK memory benchmark cannot rot;
and its baseline, bench/gumbel_legacy.py, computes the method's step, so what it measures is the same step.

The quick test runs the quick case at vocab 4,096 and 8 new tokens (the default quick case, 49,152 and 32, takes
about 5.5 minutes on 2 cores); each of the three paths is measured and must match the estimator's prediction, which
runs the same step on fake tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_loader import load_bench

from lit_rl.methods import GumbelTopK

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_gumbel_topk.py"
PATHS = ["legacy", "top-k", "top-k + ckpt"]
PHASES = ["generate", "reward", "backward", "optimizer", "**step peak**"]


def _table(text: str, heading: str) -> list[list[str]]:
    """Body rows of the first markdown table after ``heading`` (a table ends at a blank line), as stripped cells."""
    after = text.split(heading, 1)[1]
    block = after[after.index("\n|") + 1 :].split("\n\n", 1)[0]
    return [[c.strip() for c in row.strip("|").split("|")] for row in block.splitlines()[2:]]


def _mib(cell: str) -> float:
    return float(cell.split()[0].replace(",", ""))


def test_the_legacy_baseline_computes_the_loss_and_gradients_of_top_k_over_the_whole_vocabulary():
    settings = dict(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, hard=False, beta=0.1,
                    temperature=1.3, learning_rate=1e-2)  # fmt: skip
    out = []
    with load_bench("gumbel_legacy.py") as legacy:
        for method in (legacy.LegacyGumbelTopK(**settings), GumbelTopK(**settings, gumbel_topk=10**6)):
            method.setup("fit")
            method.configure_model()
            method.double()
            torch.manual_seed(1)
            ids = torch.randint(3, 90, (3, 7))
            mask = torch.ones_like(ids)
            mask[0, :2] = 0  # left padding
            ids[mask == 0] = method.tokenizer.pad_token_id
            torch.manual_seed(0)
            rollout = method.soft_rollout(ids, mask, method.tau_at(0))
            loss = (method.hparams.beta * rollout.kl.sum(1) - method.score(ids, mask, rollout)).mean()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in method.policy.named_parameters()}
            # the dense [V, H] product also reaches the padding row, which a lookup (the method's gather) leaves alone
            grads["model.embed_tokens.weight"][method.policy.get_input_embeddings().padding_idx] = 0
            out.append((loss.detach(), rollout.tokens, grads))
    (loss_a, tokens_a, a), (loss_b, tokens_b, b) = out
    assert torch.equal(tokens_a, tokens_b)  # the same noise draw, the same tokens
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-10, atol=1e-12)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-8, atol=1e-10, msg=name)


def test_the_legacy_baseline_refuses_what_it_has_not():
    with load_bench("gumbel_legacy.py") as legacy, pytest.raises(ValueError, match="checkpoint_steps or bptt_window"):
        legacy.LegacyGumbelTopK(name_or_path="tiny:llama", reward_model="tiny:llama", checkpoint_steps=True)


@pytest.mark.bench
@pytest.mark.slow  # bench/bench_gumbel_topk.py --quick in a subprocess
def test_quick_bench_prints_every_table(tmp_path):
    done = subprocess.run(
        # a 4,096-token vocabulary and 8 new tokens: every table, in a fraction of the 49k case's minutes
        [sys.executable, str(BENCH), "--quick", "--vocab", "4096", "--new-tokens", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "This file: `python bench/bench_gumbel_topk.py --quick --vocab 4096 --new-tokens 8 --out" in text

    phases = _table(text, "### Per-phase peaks")
    assert [(r[0], r[1], r[2], r[3]) for r in phases] == [("4,096", "8", p, ph) for p in PATHS for ph in PHASES]
    for *_, path, phase, predicted, measured, error, rss in phases:
        assert _mib(predicted) > 0 and _mib(measured) > 0
        assert abs(float(error)) < 1.0, (path, phase)
        assert (_mib(rss) > _mib(measured)) if phase == "**step peak**" else rss == ""

    (summary,) = _table(text, "### Step peak")
    legacy, topk, ckpt = (_mib(c) for c in summary[2:5])
    assert min(legacy, topk, ckpt) > 0
    for cell, (a, b) in zip(summary[5:8], [(legacy, topk), (legacy, ckpt), (topk, ckpt)]):
        assert cell.endswith("x") and abs(float(cell[:-1]) - a / b) < 0.01  # the cells are rounded to 0.1 MiB
    assert float(summary[-1]) < 1.0  # worst phase error %
    # the reading under the table is the table's own ratios (one config: each range is a single ratio)
    one, two = (f"{float(c[:-1]):.2f}-{float(c[:-1]):.2f}x lower with" for c in summary[5:7])
    assert f"{one} top-k, {two} top-k + ckpt than on the legacy path; weights" in text

    assert "(one length only: no growth to show)" in text
    mass = _table(text, "### Top-256 mass")
    assert [r[1] for r in mass] == ["top-k", "top-k + ckpt"]
    assert all(0 < float(r[2]) <= 1 for r in mass)
    breakdown = _table(text, "### Where the steady-state peak goes")
    assert [r[0] for r in breakdown] == ["parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                         "other", "total"]  # fmt: skip

    assert (tmp_path / "gumbel_topk.md").read_text().count("### ") >= 4
    assert (tmp_path / "gumbel_topk_peak_vs_length.png").stat().st_size > 0
