"""One exception hierarchy for everything a user can get wrong.

Every error carries a one-line message and a `hint`: the next thing to try. The CLI prints
``error: <message>`` and ``hint: <hint>`` and exits non-zero; no traceback for these.
"""

from __future__ import annotations


class MoepackError(Exception):
    """Base of all moepack errors a user can act on."""

    exit_code = 1
    default_hint = ""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:
        return self.message


class SourceError(MoepackError):
    """The source checkpoint cannot be used as it is (missing files, missing tensors, bad config)."""

    default_hint = "check that the source folder is a complete MLX or Hugging Face checkpoint"


class UnsupportedArchitectureError(SourceError):
    """config.json names a model_type moepack has no architecture file for."""


class CorruptFileError(MoepackError):
    """A file's bytes do not match what it claims: truncated, bad header, checksum mismatch."""

    default_hint = "the file is damaged or incomplete; download or convert it again"


class ShapeError(MoepackError):
    """A tensor has a shape or dtype other than the model config implies."""

    default_hint = "the checkpoint does not match its config.json; re-download or re-export it"


class QuantizationError(MoepackError):
    """Unsupported bit width or group size, or a group size that does not divide a dimension."""

    default_hint = "supported: --bits 2, 3, 4 or 8 with a group size (default 64) that divides every input dim"


class OutputError(MoepackError):
    """The output folder cannot be used: it holds something else, or a conversion with other settings."""

    default_hint = "choose another output folder, or pass --force to replace it"


class DiskSpaceError(MoepackError):
    """Not enough free disk for the output."""

    default_hint = "free some disk space or write the packed model to another disk"


class PackedModelError(MoepackError):
    """A packed model folder is incomplete or fails its manifest checks."""

    default_hint = "run `moepack verify PACKED` for details; re-run the conversion or re-download the model"
