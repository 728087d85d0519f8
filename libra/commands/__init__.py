"""Operator commands behind ``python -m libra``: ``plan``, ``tree`` (with its offline profiler) and ``demo``."""
