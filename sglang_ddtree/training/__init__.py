"""Train a small real target + DFlash draft pair on the Python sources of the machine.

corpus.py     installed Python sources, held-out packages, deterministic order
tokenizer.py  byte-level BPE with ChatML and the DFlash mask token
data.py       token streams, seeded windows and block anchors
target.py     Qwen3_5ForConditionalGeneration: config, next-token training, held-out loss
draft_model.py  the DFlash draft as a trainable module (the reference drafter's math, batched)
draft.py      draft training with the target frozen; the acceptance proxy
loops.py      AdamW + warmup/cosine, time-budgeted step planning
pipeline.py   the whole run (scripts/train_pair.py is its command line); see docs/training.md
"""
