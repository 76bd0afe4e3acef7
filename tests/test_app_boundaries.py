"""Each module of an app is either its public face or protected by one of pyproject.toml's
import-linter contracts (docs/architecture.md, "Layers, checked"): a new module stays
private until someone decides otherwise."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("tenants", "billing", "batches", "requestlogs", "adapters")
PUBLIC = {"tenants.apis.base", "tenants.apis.serializers"}
PUBLIC_NAMES = {"facade", "tasknames"}


def _protected() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {module for contract in config["tool"]["importlinter"]["contracts"]
            if contract["type"] == "protected" for module in contract["protected_modules"]}


def _modules(app: str) -> list[str]:
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts)
                  for path in (ROOT / app).rglob("*.py") if path.name != "__init__.py")


def _covered(module: str, protected: set[str]) -> bool:
    parts = module.split(".")
    ancestors = {".".join(parts[:n]) for n in range(2, len(parts) + 1)}
    return bool(ancestors & (protected | PUBLIC)) or parts[-1] in PUBLIC_NAMES


def test_every_app_module_is_public_or_protected():
    protected = _protected()
    loose = [m for app in APPS for m in _modules(app) if not _covered(m, protected)]
    assert loose == []
