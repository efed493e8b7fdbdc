"""Speculator training: answers from the base model, the trainer, its data and evaluation.

Builds on `engine` (never the reverse): `specserve-train-speculator` / `python -m training.train`.
"""
