"""The count check shared by the families' configurations, run before anything is derived from the counts (so
that `hidden_size=0` or `num_hidden_layers=2.0` raise a `ValueError` naming the field, not a `ZeroDivisionError` or
`TypeError` from a derived value) and again by `validate_architecture`."""

from __future__ import annotations


def check_counts(config, positive: tuple[str, ...], non_negative: tuple[str, ...] = (),
                 derived: tuple[str, ...] = ()) -> None:
    """`ValueError` naming the field unless every field of `positive` is an integer >= 1 and every field of
    `non_negative` an integer >= 0; a field of `derived` may also be None (the config derives it from others). A
    bool is refused (`True` as a layer count is a mistake), and so is a float such as 2.0 (config.json says 2)."""
    for fields, low in ((positive, 1), (non_negative, 0)):
        for field in fields:
            value = getattr(config, field)
            if value is None and field in derived:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                kind = "a positive integer" if low else "an integer >= 0"
                raise ValueError(f"{type(config).__name__}.{field}={value!r} is invalid: it must be {kind}.")
