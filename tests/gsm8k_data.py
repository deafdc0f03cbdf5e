"""GSM8K-shaped datasets built in code for the tests: saved folders, a hub repository's layout, and a datasets cache
that a hub id resolves to offline. Nothing is downloaded.

The rows have GSM8K's fields (``question``, ``answer`` ending in ``#### <number>``, as in ``openai/gsm8k``), a
message-list copy of the question (``messages``) and verl's nested ``reward_model.ground_truth``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any


def gsm8k_rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` word problems with GSM8K's fields, and the same question as a conversation and verl's nested answer."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        question = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now? (#{i})"
        total = a + b
        rows.append(
            {
                "question": question,
                "answer": f"Tom starts with {a} and buys {b}, so {a} + {b} = <<{a}+{b}={total}>>{total}.\n#### {total}",
                "messages": [
                    {"role": "system", "content": "Reason step by step, then give the final answer after ####."},
                    {"role": "user", "content": question},
                ],
                "reward_model": {"ground_truth": str(total), "style": "rule"},
            }
        )
    return rows


def save_gsm8k(folder: Path, n: int = 64, *, splits: tuple[str, ...] | None = ("train", "test")) -> Path:
    """Save ``n`` rows per split with ``DatasetDict.save_to_disk`` (``splits=None``: one ``Dataset``, no splits)."""
    from datasets import Dataset, DatasetDict

    if splits is None:
        Dataset.from_list(gsm8k_rows(n)).save_to_disk(str(folder))
    else:
        DatasetDict({s: Dataset.from_list(gsm8k_rows(n, seed=k)) for k, s in enumerate(splits)}).save_to_disk(
            str(folder)
        )
    return folder


def hub_layout(folder: Path, n: int = 16) -> Path:
    """A folder laid out as a hub dataset repository: subsets ``main`` (train, test) and ``socratic`` (train), with
    each split's size in the README's metadata (``4000 * n`` bytes)."""
    from datasets import Dataset

    files = {"main": ("train", "test"), "socratic": ("train",)}
    for subset, splits in files.items():
        (folder / subset).mkdir(parents=True, exist_ok=True)
        for k, split in enumerate(splits):
            Dataset.from_list(gsm8k_rows(n, seed=k)).to_parquet(
                str(folder / subset / f"{split}-00000-of-00001.parquet")
            )
    configs = "".join(
        f"- config_name: {subset}\n  data_files:\n"
        + "".join(f"  - split: {split}\n    path: {subset}/{split}-*\n" for split in splits)
        for subset, splits in files.items()
    )
    # the split sizes the hub reports before anything is downloaded, as in openai/gsm8k's README
    info = "".join(
        f"- config_name: {subset}\n  splits:\n"
        + "".join(f"  - name: {split}\n    num_bytes: {4000 * n}\n    num_examples: {n}\n" for split in splits)
        for subset, splits in files.items()
    )
    (folder / "README.md").write_text(f"---\nconfigs:\n{configs}dataset_info:\n{info}---\n")
    return folder


def cache_as_hub_id(repo: Path, hub_id: str, cache: Path, subset: str = "main") -> None:
    """Prepare ``repo``'s ``subset`` in the datasets cache ``cache`` under the name of ``hub_id``, as ``load_dataset``
    leaves a hub dataset it downloaded, so that ``hub_id`` loads offline (HF_DATASETS_OFFLINE=1) from the cache."""
    import datasets

    datasets.load_dataset_builder(str(repo), subset, cache_dir=str(cache)).download_and_prepare()
    owner, name = hub_id.split("/")
    for prepared in (cache / repo.name / subset).glob("*/*"):
        if prepared.is_dir():
            target = cache / f"{owner}___{name}" / subset / prepared.relative_to(cache / repo.name / subset)
            target.mkdir(parents=True)
            for file in prepared.iterdir():
                if file.suffix in (".json", ".arrow"):
                    shutil.copy(file, target / file.name.replace(f"{repo.name}-", f"{name}-"))
