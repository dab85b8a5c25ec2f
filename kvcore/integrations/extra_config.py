"""An engine's extra config (JSON keys and values, as vLLM's ``kv_connector_extra_config``
and SGLang's ``--hicache-storage-backend-extra-config`` give them) as a dataclass."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields, replace
from typing import Any, Protocol, TypeVar

from kvcore.errors import BadRequest
from kvcore.paths import default_endpoint


class HasEndpoint(Protocol):
    @property
    def endpoint(self) -> str: ...


C = TypeVar("C", bound=HasEndpoint)


def parse_extra(
    cls: type[C], extra: Mapping[str, Any] | None, *, what: str, ignore: Collection[str] = ()
) -> C:
    """``cls`` (a dataclass with a str ``endpoint`` and defaults for every other field)
    from ``extra``: each key given is converted to its field's type (that of the field's
    default), the rest keep the defaults; an empty or absent ``endpoint`` is the default
    daemon's ($KVCORE_ENDPOINT). Keys in ``ignore`` belong to the engine and are skipped.
    BadRequest for an unknown key or a value of the wrong kind, naming ``what``."""
    given = {k: v for k, v in (extra or {}).items() if k not in ignore}
    unknown = set(given) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise BadRequest(f"unknown {what} keys for kvcore: {sorted(unknown)}")
    config = cls(endpoint=str(given.pop("endpoint", None) or default_endpoint()))  # type: ignore[call-arg]
    return replace(
        config, **{k: _convert(what, k, v, getattr(config, k)) for k, v in given.items()}
    )  # type: ignore[type-var]


def _convert(what: str, key: str, value: Any, default: Any) -> Any:
    """``value`` as the type of ``default``; a bool from a bool or "true"/"false"
    (JSON configs and command lines give either), BadRequest otherwise."""
    if not isinstance(default, bool):
        try:
            return type(default)(value)
        except (TypeError, ValueError):
            raise BadRequest(
                f"{what} {key!r} must be a {type(default).__name__}, got {value!r}"
            ) from None
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise BadRequest(f"{what} {key!r} must be true or false, got {value!r}")
