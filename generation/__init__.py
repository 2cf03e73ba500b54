"""Sampling from a model with recurrent decoding (models.inference): loading a checkpoint, the sampler and the
batched decode loop."""

from generation.decoding import generate, left_pad
from generation.load import load_checkpoint
from generation.sampling import SamplingParams, sample_next_tokens

__all__ = ["SamplingParams", "sample_next_tokens", "generate", "left_pad", "load_checkpoint"]
