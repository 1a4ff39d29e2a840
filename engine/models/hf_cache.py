"""The keyword a model's forward takes its KV cache by, and the output field it returns it in.

transformers 5.24.0 renamed both from `past_key_values` to `cache`: every model forward now takes `cache`
(`@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`: the old keyword still works until 5.40 but
raises a FutureWarning on each call) and model outputs carry the `cache` field (`output.past_key_values` is a
property that logs a deprecation). 5.0.0 to 5.23.0 take and return `past_key_values` only. pyproject allows
both (`transformers>=5.0,<6`), so every call that hands a cache to a model, or reads one back from its output,
goes through `cache_argument` / `returned_cache`.

The keyword is read from the signature of the model class's `forward`, once per class: transformers'
decorator keeps the wrapped signature (`functools.wraps`), so a 5.24 forward shows `cache`; a 5.0-5.23 one and
TreeServe's own drafter models (their forwards and outputs keep `past_key_values`) show `past_key_values`.
Torch-free.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

CACHE = "cache"  # transformers >= 5.24.0
PAST_KEY_VALUES = "past_key_values"  # transformers 5.0.0 - 5.23.0, TreeServe's drafter models


@lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """`cache` if `model_class.forward` takes a parameter of that name, else `past_key_values`."""
    return CACHE if CACHE in inspect.signature(model_class.forward).parameters else PAST_KEY_VALUES


def cache_argument(model, cache) -> dict:
    """`{keyword: cache}` to pass to `model(...)` (call it as `model(..., **cache_argument(model, cache))`)."""
    return {cache_keyword(type(model)): cache}


def returned_cache(model, output):
    """The cache in `output` of `model`'s forward, read from the field of the same name as its keyword."""
    return getattr(output, cache_keyword(type(model)))
