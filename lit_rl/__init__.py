"""lit-rl: memory-efficient RL fine-tuning of language models on PyTorch Lightning."""

__version__ = "0.1.0"
