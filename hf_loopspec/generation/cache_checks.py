"""Up-front checks of the KV cache a `generate` or forward call is given, in every mode (plain decoding included):
a transformers `Cache`, one of them, without sliding-window layers, one the call decodes with, and no
`cache_implementation` that plain decoding cannot size for a looped model."""

from __future__ import annotations

from transformers.cache_utils import Cache


def check_cache_type(cache, name: str) -> None:
    """`ValueError` naming `name` for a cache that is no transformers `Cache` (the legacy tuples, or a mistake), or one
    with sliding-window layers, which keep only their last columns where a looped model attends to all of them."""
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"{name}: a {type(cache).__name__} is no transformers Cache; pass a Cache (a DynamicCache, "
                         "the PagedLoopCache or DynamicCache an earlier call returned) or None for a fresh one.")
    sliding = [i for i, layer in enumerate(getattr(cache, "layers", None) or []) if getattr(layer, "is_sliding", 0)]
    if sliding:
        raise ValueError(f"{name}: a {type(cache).__name__} with sliding-window layers ({sliding[:4]}...: "
                         f"{type(cache.layers[sliding[0]]).__name__}), which keep only their last columns, but a "
                         "looped model attends to its whole history: pass `DynamicCache()`, "
                         "`hf_loopspec.PagedLoopCache` or None.")


def check_one_cache(cache, past_key_values) -> None:
    """`ValueError` unless a call's `cache` and `past_key_values` (transformers >= 5.24 names it `cache`) are each a
    `Cache` or None (`check_cache_type`), and not both given."""
    check_cache_type(cache, "cache")
    check_cache_type(past_key_values, "past_key_values")
    if cache is not None and past_key_values is not None:
        raise ValueError("Pass the KV cache as `cache` or as `past_key_values`, not both.")


LOOPED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")  # what plain decoding sizes for a looped model


def check_cache_implementation(generation_config, cache) -> None:
    """`ValueError` for a `cache_implementation` that plain decoding would build the cache with (no `cache` passed,
    caching on) and cannot size for a looped model. Auto mode checks it up front, as any of its stretches may be
    plain."""
    implementation = generation_config.cache_implementation
    if cache is None and generation_config.use_cache is not False \
            and implementation not in LOOPED_CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={implementation!r}: a looped model's cache holds one KV per (loop, layer), and "
            "hf_loopspec sizes one only for cache_implementation 'dynamic' (the default) or 'static'; pass one of "
            "these, or a cache of your own (cache=...).")


def check_cache_use(kwargs: dict, model_config) -> None:
    """`ValueError` for a `generate` call (`kwargs`) given no `Cache` (`check_cache_type`), or a cache that it would
    decode without (`use_cache=False`: the call's, its generation config's or `model_config`'s): every step would
    write the whole sequence into it again, and the call would return without it. A call given both `cache` and
    `past_key_values` is refused as a forward call is (`check_one_cache`): transformers decoded into `cache` alone."""
    check_one_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
    name = next((key for key in ("cache", "past_key_values") if kwargs.get(key) is not None), None)
    given = (kwargs.get("use_cache"), getattr(kwargs.get("generation_config"), "use_cache", None),
             getattr(model_config, "use_cache", None))
    if name is not None and next((value for value in given if value is not None), True) is False:
        raise ValueError(f"{name}: a cache given to a call with use_cache=False, which decodes without one; drop "
                         f"{name}, or pass use_cache=True to continue it.")
