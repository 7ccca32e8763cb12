"""tandem's version: the installed package's (setup.cfg's `version`), for `tandem --version`
and the HTTP front's `GET /version`."""

from __future__ import annotations


def installed_version() -> str | None:
    """The installed package's version; None when run from a checkout never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return None
