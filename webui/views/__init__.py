"""The console's views: entry points that parse, call one selector or service, and render.

`public` holds the landing page and the health check; `tenant` the tenant console;
`operator` the operator console (staff only). `base` holds what they share: who is
signed in, which tenant they act in, and what they may do there.
"""

from webui.views.public import index, livez, readyz

__all__ = ["index", "livez", "readyz"]
