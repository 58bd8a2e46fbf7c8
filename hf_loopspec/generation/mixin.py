"""The `GenerationMixin` subclass that every hf_loopspec model inherits."""

from __future__ import annotations

from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin


class LoopSpecGenerationMixin(GenerationMixin):
    """Generation for looped models.

    A looped model writes one KV entry per (loop, layer), so the default cache must hold
    `num_loops x num_layers` layers rather than the `num_hidden_layers` that transformers sizes it for.
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        default = model_kwargs.get("cache") is None and generation_config.use_cache is not False \
            and generation_config.cache_implementation is None
        if default:
            model_kwargs["cache"] = DynamicCache()
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)
