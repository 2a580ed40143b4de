"""The Hugging Face hub: publish packed models (model card + resumable upload), pull them (download + one-time verify).

* :mod:`moepack.hub.card` -- the model card (README.md) generated from the manifest, user edits kept;
* :mod:`moepack.hub.publish` -- ``moepack publish``: verify, write the card, create the repo, upload;
* :mod:`moepack.hub.pull` -- ``moepack pull`` and :func:`resolve_packed`, which other commands call so that they
  accept a hub repo id wherever they accept a packed folder.

Nothing here imports huggingface_hub (slow, and it reads its environment variables at import) until it is needed.
"""

from __future__ import annotations

import re

from ..errors import MoepackError

# org/name, as the hub spells repo ids (same rule as moepack.source.checkpoint)
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(MoepackError):
    """Talking to the hub failed, or what it holds is not what moepack needs."""

    default_hint = "check the repo id and your network connection; `hf auth whoami` shows who you are logged in as"


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID_RE.match(text)) and ".." not in text


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def transport_errors() -> tuple[type, ...]:
    """Exception types meaning "the network failed" for the HTTP stacks huggingface_hub versions use."""
    import contextlib

    errs: list[type] = [ConnectionError, TimeoutError]
    for mod, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                      ("requests", "ConnectionError"), ("requests", "Timeout")):
        with contextlib.suppress(ImportError, AttributeError):
            errs.append(getattr(__import__(mod), name))
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import OfflineModeIsEnabled

        errs.append(OfflineModeIsEnabled)
    return tuple(errs)


def __getattr__(name):  # lazy: `from moepack.hub import resolve_packed` imports only what it needs
    # (the functions `pull` and `publish` share their modules' names: import them from moepack.hub.pull/.publish)
    if name in ("resolve_packed", "PullResult"):
        from . import pull as _pull

        return getattr(_pull, name)
    if name in ("prepare_publish", "upload", "PublishPlan", "PublishResult"):
        from . import publish as _publish

        return getattr(_publish, name)
    if name in ("render_card", "write_card"):
        from . import card as _card

        return getattr(_card, name)
    raise AttributeError(name)
