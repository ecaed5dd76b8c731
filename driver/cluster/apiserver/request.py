"""Per-request options of the embedded API emulator (a test double), read from the query string as
kube-apiserver reads them: ``dryRun``, ``fieldValidation``, ``fieldManager``, ``force``. Warnings
collected while serving the request go back in ``Warning`` headers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from driver.cluster.apiserver.store import StatusError

__all__ = ["FieldValidation", "RequestOptions", "parse_options"]


class FieldValidation(StrEnum):
    """What the server does with unknown fields (``fieldValidation``; ``Warn`` is its default)."""

    IGNORE = "Ignore"
    WARN = "Warn"
    STRICT = "Strict"


@dataclass(slots=True)
class RequestOptions:
    dry_run: bool = False
    field_validation: FieldValidation = FieldValidation.WARN
    field_validation_sent: bool = False  # the query named it (admission's options carry it only then)
    field_manager: str | None = None
    default_manager: str = ""  # who an update is recorded under without fieldManager: the user agent's
    force: bool = False
    warnings: list[str] = field(default_factory=list)


def manager_from_user_agent(user_agent: str | None) -> str:
    """kube-apiserver's default field manager: the User-Agent up to its first "/", at most 128 bytes."""
    return (user_agent or "").split("/", 1)[0][:128]


def parse_options(query: dict[str, str], user_agent: str | None = None) -> RequestOptions:
    """The options of one request; 400 for values the apiserver refuses."""
    dry_run = query.get("dryRun")
    if dry_run not in (None, "", "All"):
        raise StatusError(
            code=400,
            reason="BadRequest",
            message=f'dryRun: Unsupported value: "{dry_run}": supported values: "All"',
        )
    mode = query.get("fieldValidation") or "Warn"
    try:
        field_validation = FieldValidation(mode)
    except ValueError:
        raise StatusError(
            code=400,
            reason="BadRequest",
            message=f'fieldValidation: Unsupported value: "{mode}": supported values: '
            '"Ignore", "Strict", "Warn"',
        ) from None
    manager = query.get("fieldManager") or None
    if manager is not None and len(manager) > 128:
        raise StatusError(
            code=422,
            reason="Invalid",
            message=f"fieldManager: Too long: may not be more than 128 bytes (was {len(manager)})",
        )
    force = query.get("force") in ("true", "1")
    return RequestOptions(
        dry_run=dry_run == "All",
        field_validation=field_validation,
        field_validation_sent=bool(query.get("fieldValidation")),
        field_manager=manager,
        default_manager=manager_from_user_agent(user_agent),
        force=force,
    )
