"""How a request's ``model`` names an adapter (docs/adapters.md).

    <base model>                          the base model alone
    <base model>:<adapter>                the caller's own adapter, its newest ready version
    <base model>:<adapter>@<version>      a given version
    <base model>:<owner>/<adapter>[@v]    a public adapter of another tenant
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_REF = re.compile(r"^(?:(?P<owner>[a-z0-9][a-z0-9_-]{0,63})/)?(?P<name>[^@/]+)"
                  r"(?:@(?P<version>[1-9][0-9]{0,8}))?$")


@dataclass(frozen=True, slots=True)
class ModelRef:
    base: str
    adapter: str | None = None
    owner: str | None = None  # a tenant slug, for another tenant's public adapter
    version: int | None = None


def parse_model(value: str) -> ModelRef | None:
    """The parts of a ``model`` value, or None if it cannot name anything."""
    base, sep, rest = value.partition(":")
    if not sep:
        return ModelRef(base=value)
    match = _REF.match(rest)
    if not base or match is None or not NAME.match(match["name"]):
        return None
    version = match["version"]
    return ModelRef(base=base, adapter=match["name"], owner=match["owner"],
                    version=int(version) if version else None)


def model_id(*, base: str, name: str, owner: str | None = None,
             version: int | None = None) -> str:
    ref = f"{owner}/{name}" if owner else name
    return f"{base}:{ref}" + (f"@{version}" if version else "")
