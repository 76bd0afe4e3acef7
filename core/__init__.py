"""The bottom layer: errors, the Redis client, API base classes, settings access.

It imports no app (tenants, billing, adapters, requestlogs), no inference API and no
console; `lint-imports` holds that (pyproject.toml).
"""
