"""Checks for a job's `config` object: each failure names the field, and becomes a 400."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class InvalidJob(ValueError):
    """An unknown kind or a config the kind refuses; the message is the reason."""


def known_fields(config: Mapping[str, Any], allowed: Iterable[str]) -> None:
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise InvalidJob(f"unknown config field '{unknown[0]}'")


def int_field(config: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJob(f"{name} must be an integer")
    if not lo <= value <= hi:
        raise InvalidJob(f"{name} must be between {lo} and {hi}")
    return value


def str_field(config: Mapping[str, Any], name: str, *, required: bool = False) -> str | None:
    value = config.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidJob(f"{name} must be a non-empty string")
    return value


def bool_field(config: Mapping[str, Any], name: str, default: bool) -> bool:
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise InvalidJob(f"{name} must be true or false")
    return value


def int_list_field(
    config: Mapping[str, Any], name: str, default: list[int], lo: int, hi: int
) -> list[int]:
    value = config.get(name, default)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidJob(f"{name} must be a non-empty list of integers")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
            raise InvalidJob(f"{name} entries must be integers between {lo} and {hi}")
    return list(value)


def url_field(config: Mapping[str, Any], name: str) -> str | None:
    value = str_field(config, name)
    if value is not None and not value.startswith(("http://", "https://")):
        raise InvalidJob(f"{name} must be an http(s) URL")
    return value
