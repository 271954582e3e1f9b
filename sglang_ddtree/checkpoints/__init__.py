"""Seeded tiny checkpoints the product builds: the demo's fallback pair, the training recipe's
model configs and tokenizer, the GPU suite's agreeing binary pairs (`tiny.py`, `binary_pair.py`)."""
