"""Decoding strategies for looped models, reached through `model.generate`."""
