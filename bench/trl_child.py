"""The TRL side of the comparison (``bench/vs_trl.py``): TRL ``GRPOTrainer`` doing the same work as lit-rl's run.

Run in a fresh process per measurement, like the lit-rl side. Same model (the embedded SmolLM2-135M-Instruct's
converted safetensors folder, float32), same prompts (``PromptDataModule``'s arithmetic records, formatted by its own
``format_prompt``, so the chat template and the instruction are identical), 2 prompts x 4 generations per step,
completions forced to ``--length`` tokens (``min_new_tokens`` in ``generation_kwargs``), beta, clipping, loss type and
learning rate as ``bench/grpo_vs_trl.yaml``. One generation per optimizer step (``steps_per_generation = 1``,
``num_iterations = 1``, no gradient accumulation), no vLLM, CPU, fp32 (``--bf16``: bf16 mixed precision, float32
weights under CPU autocast, as lit-rl's ``bf16-mixed``), logging every step, no evaluation, no saving.

Writes ``--out``: ``{"step_s": [...], "peak_rss_bytes": int, "threads": int}`` (the same as ``step_timer.StepTimer``);
with ``--cuda`` (on a GPU, ``bench/device_check.py``) also the allocator's peaks. ``--model``: another model folder.

    PYTHONPATH=.:bench python bench/trl_child.py --length 64 --steps 4 --out /tmp/trl.json [--lora] [--no-checkpointing] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, required=True, help="completion tokens, every completion forced to it")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True, help="JSON file for the step times and the peak RSS")
    p.add_argument("--lora", action="store_true", help="LoRA r16, alpha 32, all-linear (else full fine-tuning)")
    p.add_argument("--no-checkpointing", action="store_true", help="gradient_checkpointing=False (TRL's default: on)")
    p.add_argument("--bf16", action="store_true", help="bf16=True: bf16 mixed precision (float32 weights, autocast)")
    p.add_argument("--model", help="a model folder (default: the embedded SmolLM2-135M-Instruct's converted folder)")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (use_cpu=False); records its allocator peaks")
    return p.parse_args(argv)


def prompts(tokenizer, n: int) -> list[dict]:
    """``n`` prompt records as lit-rl's data module formats them (``bench/grpo_vs_trl.yaml``'s data settings)."""
    from lit_rl.data import PromptDataModule

    dm = PromptDataModule(source="arithmetic", difficulty=1, num_prompts=2000, batch_size=2, max_prompt_length=128)
    dm.connect(tokenizer)
    records = dm.prepare_records()[:n]
    return [{"prompt": dm.format_prompt(r["prompt"]), "answer": r["answer"]} for r in records]


def correct_answer(completions, answer, **_):
    """lit-rl's reward function (``lit_rl.data.rewards.correct_answer``) under TRL's reward-function signature."""
    from lit_rl.data import correct_answer as reward

    return reward(list(completions), list(answer))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from datasets import Dataset
    from harness import peak_rss_bytes
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_rl.models import embedded_default_path

    folder = args.model or str(embedded_default_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    step_s: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_s.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=not args.cuda,
            bf16=args.bf16,
            fp16=False,
            model_init_kwargs={"dtype": torch.float32},
            per_device_train_batch_size=8,  # completions: 2 prompts x 4 generations
            num_generations=4,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=args.length,
            generation_kwargs={"min_new_tokens": args.length},
            temperature=1.0,
            beta=0.04,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            scale_rewards="group",
            learning_rate=1e-5,
            max_grad_norm=1.0,
            max_steps=args.steps,
            gradient_checkpointing=not args.no_checkpointing,
            logging_steps=1,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            use_vllm=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(
            model=folder,
            reward_funcs=correct_answer,
            args=config,
            train_dataset=Dataset.from_list(prompts(tokenizer, 2000)),
            processing_class=tokenizer,
            peft_config=peft if args.lora else None,
            callbacks=[Timer()],
        )
        trainer.train()
    record = {"step_s": step_s, "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads()}
    if args.cuda:
        record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
