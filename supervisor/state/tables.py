"""The repositories of the store's own tables: the checkpoint (`meta`), the policy's memory
(`unit_state`), the crash history (`history`) and the actions decided, not yet taken
(`pending_action`). Each is the only SQL of its table; it works on the connection it is given
(the writer's inside a unit of work, or the reader's)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog

from ..model import Ended, Outcome
from ..records import Pending, ended_record, outcome_record, pending_from_record
from ..util.jsontext import loads
from ..util.when import utc

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """Where reading resumes.

    `cursor` is the last entry fully handled. `replay_from` is the first entry of the oldest
    invocation still open at that point: reading restarts there so the open invocation's lines
    are tracked again, but nothing up to `cursor` is acted on a second time.
    """

    cursor: str | None = None
    replay_from: str | None = None


class Meta:
    """`meta`: the checkpoint."""

    TABLES: ClassVar[tuple[str, ...]] = ("meta",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def checkpoint(self) -> Checkpoint:
        rows = dict(
            self._db.execute("SELECT key, value FROM meta WHERE key IN ('cursor','replay')")
        )
        return Checkpoint(cursor=_text(rows.get("cursor")), replay_from=_text(rows.get("replay")))

    def save(self, checkpoint: Checkpoint) -> None:
        for key, value in (("cursor", checkpoint.cursor), ("replay", checkpoint.replay_from)):
            if value is None:
                self._db.execute("DELETE FROM meta WHERE key = ?", (key,))
            else:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


class UnitStateTable:
    """`unit_state`: the policy's memory per unit."""

    TABLES: ClassVar[tuple[str, ...]] = ("unit_state",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def load(self) -> dict[str, dict[str, Any]]:
        # A unit left out starts its streak again: at worst one more crash before a halt.
        rows = self._db.execute("SELECT unit, state FROM unit_state")
        return json_objects_by_unit(rows, table="unit_state")

    def save(self, states: Mapping[str, Mapping[str, Any]], *, whole: bool = False) -> None:
        """Save `states`; `whole`: they are all the memory there is, so a unit left out (a
        `release` forgot it) is forgotten here too, not read back at the next start."""
        if whole:
            kept = list(states)
            marks = ",".join("?" * len(kept))
            self._db.execute(f"DELETE FROM unit_state WHERE unit NOT IN ({marks})", kept)  # noqa: S608
        self._db.executemany(
            "INSERT OR REPLACE INTO unit_state VALUES (?, ?)",
            [(unit, dump(state)) for unit, state in states.items()],
        )


class History:
    """`history`: every classified invocation, once, as the triage JSON."""

    TABLES: ClassVar[tuple[str, ...]] = ("history",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def add(self, outcomes: Sequence[Outcome], now: float) -> None:
        """Record the outcomes (a replayed one is already there and stays as it was)."""
        self._db.executemany(
            "INSERT OR IGNORE INTO history (unit, invocation_id, time, outcome)"
            " VALUES (?, ?, ?, ?)",
            [
                (o.invocation.unit, o.invocation.invocation_id, now, dump(o.to_json()))
                for o in outcomes
            ],
        )

    def mark_notified(self, invocations: Iterable[tuple[str | None, str | None]]) -> None:
        """Mark recorded invocations (unit, invocation id) as told."""
        self._db.executemany(
            "UPDATE history SET notified = 1 WHERE unit IS ? AND invocation_id IS ?",
            list(invocations),
        )

    def add_note(self, unit: str | None, invocation_ids: Sequence[str], note: str) -> None:
        """Append `note` to the verdict notes of invocations already recorded."""
        for invocation_id in invocation_ids:
            row = self._db.execute(
                "SELECT id, outcome FROM history WHERE unit IS ? AND invocation_id = ?",
                (unit, invocation_id),
            ).fetchone()
            if row is None:
                continue
            outcome = loads(row[1])
            notes = outcome.setdefault("verdict", {}).setdefault("notes", [])
            if note not in notes:
                notes.append(note)
                self._db.execute(
                    "UPDATE history SET outcome = ? WHERE id = ?", (dump(outcome), row[0])
                )

    def items(self, unit: str | None = None) -> list[dict[str, Any]]:
        """Oldest first: the triage JSON plus `time` (ISO 8601) and `notified`."""
        sql = "SELECT id, time, outcome, notified FROM history"
        args: tuple[Any, ...] = ()
        if unit is not None:
            sql, args = sql + " WHERE unit = ?", (unit,)
        result = []
        for row_id, when, outcome, notified in self._db.execute(sql + " ORDER BY id", args):
            item = json_object(outcome)
            if isinstance(item, str):
                _log.warning("state_row_unreadable", table="history", id=row_id, error=item)
                continue
            item["time"] = _iso(when)
            item["notified"] = bool(notified)
            result.append(item)
        return result


class PendingActions:
    """`pending_action`: invocations ended in a committed batch and not yet decided, and
    actions decided and not yet taken."""

    TABLES: ClassVar[tuple[str, ...]] = ("pending_action",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def add(self, ended: Sequence[Ended]) -> None:
        """Ended invocations, to be decided (one already pending stays as it is)."""
        self._db.executemany(
            "INSERT OR IGNORE INTO pending_action (unit, key, outcome) VALUES (?, ?, ?)",
            [(e.invocation.unit, key(e), dump(ended_record(e))) for e in ended],
        )

    def decide(self, decided: Sequence[Outcome]) -> None:
        """The pending records become the decisions, to be acted on."""
        self._db.executemany(
            "INSERT INTO pending_action (unit, key, outcome) VALUES (?, ?, ?) "
            "ON CONFLICT (unit, key) DO UPDATE SET outcome = excluded.outcome",
            [(o.invocation.unit, key(o), dump(outcome_record(o))) for o in decided],
        )

    def clear(self, taken: Sequence[Outcome]) -> None:
        self._db.executemany(
            "DELETE FROM pending_action WHERE unit IS ? AND key = ?",
            [(o.invocation.unit, key(o)) for o in taken],
        )

    def load(self) -> tuple[list[Pending], list[str]]:
        """The records, oldest first; and one line for each record that cannot be read (it
        stays, for a person to look at)."""
        rows = self._db.execute("SELECT unit, key, outcome FROM pending_action ORDER BY id")
        outcomes: list[Pending] = []
        unreadable = []
        for unit, name, text in rows:
            try:
                outcomes.append(pending_from_record(loads(text)))
            except (ValueError, KeyError, TypeError) as exc:
                unreadable.append(f"{unit} {name}: {type(exc).__name__}: {exc}")
        return outcomes, unreadable


STORE_TABLES = (Meta, UnitStateTable, History, PendingActions)


def key(pending: Pending) -> str:
    """What identifies an invocation of its unit: its id, else its last entry's cursor."""
    inv = pending.invocation
    return inv.invocation_id or f"cursor:{inv.last_cursor}"


def json_object(text: object) -> dict[str, Any] | str:
    """A row's JSON object, or why the row holds none (it was written behind our back)."""
    if not isinstance(text, str):
        return f"expected JSON text, got {type(text).__name__}"
    try:
        value = loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(value, dict):
        return f"expected a JSON object, got {type(value).__name__}"
    return value


def json_objects_by_unit(
    rows: Iterable[tuple[object, object]], *, table: str
) -> dict[str, dict[str, Any]]:
    """Each (unit, JSON text) row's object by unit; a row that holds none is left out with a
    line naming its table."""
    found: dict[str, dict[str, Any]] = {}
    for unit, text in rows:
        value = json_object(text)
        if isinstance(value, str):
            _log.warning("state_row_unreadable", table=table, unit=unit, error=value)
        else:
            found[str(unit)] = value
    return found


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _iso(seconds: object) -> str | None:
    when = utc(seconds)
    return None if when is None else when.isoformat()


def dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
