"""Where files' bytes live: the ``atrium-files`` storage (a folder under ATRIUM_HOME by
default; any Django storage, django-storages' S3 or GCS among them, by settings)."""

from __future__ import annotations

from django.core.files.storage import Storage, storages


def files_storage() -> Storage:
    return storages["atrium-files"]
