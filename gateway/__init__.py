"""The HTTP gateway: OpenAI-compatible API, admin API, metrics, and the `switchboard` CLI.

Request handling never imports torch: engines are reached through gateway.engine_client.
"""

from importlib import metadata


def version() -> str:
    """The installed switchboard version ("0.0.0" when run from an uninstalled checkout)."""
    try:
        return metadata.version("switchboard")
    except metadata.PackageNotFoundError:
        return "0.0.0"
