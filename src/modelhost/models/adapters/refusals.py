"""Why an adapter cannot run a request, torch-free: the stage maps each to its HTTP refusal."""

from __future__ import annotations


class AdapterRefused(ValueError):
    """An adapter this server cannot serve over its base; the message says why."""


class UnknownAdapter(LookupError):
    """No adapter of that name is known to this base."""


class AdaptersBusy(RuntimeError):
    """Every loaded adapter has running rows, and there is no room for another."""
