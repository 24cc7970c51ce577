"""The fleet's contract: how one host's halt of a crash is written to the shared Alertmanager,
and how the other hosts read it back (supervisor.notify.alertmanager writes, supervisor.decide.
fleet reads; this module is all either knows of the other).

A halt is the alert `VllmSupervisorFleetHalt` with the labels Alertmanager's API can filter on:
`crash` (the crash's fingerprint, supervisor.classify.fingerprint), `environment` (the fleet
digest of what the unit ran with, supervisor.environment.fingerprint.fleet_digest), `host`,
`unit`, and `proof`: `own` for a halt on the host's own evidence (a signature, an inferred
fatal, a repeat), `fleet` for one that rested on another host's proof. Only `own` is proof: a
halt that rested on a proof proves nothing more, so a fleet never keeps itself halted. As in
Alertmanager's inhibit rules, `EQUAL` names the labels whose values must be the same in the
proof and in the crash it is applied to.

Halts that rest on the host itself (a port another process holds, an address not assigned, a
path not there, the GPU's Xid: the record's evidence) are never published: another host's port
says nothing of this one. The labels are fingerprints and hashes only; the annotations carry
what the halt's own alert (VllmSupervisorUnitHalted) always did: its title, its root-cause line
and the fix, escaped and bounded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from .model import FleetProof, Rule
from .util.jsontext import whole_number

FLEET_ALERT = "VllmSupervisorFleetHalt"
SEVERITY = "critical"
PROOF_OWN = "own"
PROOF_FLEET = "fleet"
EQUAL = ("crash", "environment")
# The halts whose evidence is the crash itself, not this host's state.
_PROOF_OF: Mapping[str, str] = {
    Rule.FATAL_SIGNATURE.value: PROOF_OWN,
    Rule.INFERRED_FATAL.value: PROOF_OWN,
    Rule.UNKNOWN_REPEAT.value: PROOF_OWN,
    Rule.FLEET_PROOF.value: PROOF_FLEET,
}
# What a label read back must look like before it is believed: hex digests, a host name, a
# unit name (anyone who can reach Alertmanager can post an alert).
_HEX = re.compile(r"[0-9a-f]{8,64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9@:._\\-]{0,254}")
MAX_PROOFS = 1000  # alerts read from one reply, at most
# A proof's daemon re-sends it every `alertmanager.resend_s` (60 s by default, at most a few
# minutes): one Alertmanager has not heard of for this long is no live halt's.
FRESH_S = 900.0
CLOCK_SKEW_S = 300.0  # hosts' clocks may differ this much; a start later than that is forged
# Evidence kinds a halt rests on that are the host's own state: never the fleet's business.
HOST_LOCAL_EVIDENCE = frozenset({"port_held", "address_missing", "missing_path", "gpu_xid"})


def proof_of_halt(rule: str, evidence: object) -> str | None:
    """`own` or `fleet` for a halt by `rule`, resting on `evidence` (the record's: what can
    lift it), that the fleet shares; None for one that rests on this host alone: a port, an
    address, a path or a GPU of its own (an inferred fatal may rest on one)."""
    if isinstance(evidence, Mapping) and evidence.get("kind") in HOST_LOCAL_EVIDENCE:
        return None
    return _PROOF_OF.get(rule)


def proof_of(record: Mapping[str, Any]) -> str | None:
    """`proof_of_halt` of a quarantine record (a record may hold anything)."""
    return proof_of_halt(str(record.get("rule")), record.get("evidence"))


def fleet_alert(
    unit: str, record: Mapping[str, Any], *, host: str, environment: str | None
) -> dict[str, Any] | None:
    """The fleet alert of a unit's quarantine record: labels and annotations; None for a halt
    that is not the fleet's business (its rule rests on this host) or that cannot be matched
    (no crash fingerprint, no environment digest)."""
    proof = proof_of(record)
    crash = record.get("fingerprint")
    if (
        proof is None
        or environment is None
        or not isinstance(crash, str)
        or not _HEX.fullmatch(crash)
    ):
        return None
    labels = {
        "alertname": FLEET_ALERT,
        "crash": crash,
        "environment": environment,
        "host": host,
        "unit": unit,
        "proof": proof,
        "severity": SEVERITY,
    }
    crashes = whole_number(record.get("loop_crashes"))
    annotations = {
        "summary": f"{unit} on {host} halted: {record.get('title') or 'a fatal crash'}",
        # The group's message is the halt's only one (supervisor.notify.decision): the story.
        "root_cause": str(record.get("root_cause") or ""),
        "remediation": str(record.get("remediation") or ""),
        "signature": str(record.get("signature") or "unknown"),
        "halted_since": str(record.get("time") or ""),
        "crashes": str(crashes) if crashes > 0 else "",
        "release": f"vllm-supervisor release {unit} (on {host})",
    }
    return {"labels": labels, "annotations": {k: v for k, v in annotations.items() if v}}


def filters(crash: str, environment: str) -> list[str]:
    """Alertmanager API v2 `filter` matchers for the proofs of one crash and environment."""
    return [
        f'alertname="{FLEET_ALERT}"',
        f'crash="{crash}"',
        f'environment="{environment}"',
        f'proof="{PROOF_OWN}"',
    ]


def proofs(
    body: object,
    *,
    crash: str,
    environment: str,
    not_host: str,
    now: float,
    window_s: float,
) -> list[FleetProof]:
    """The proofs in Alertmanager's reply (GET /api/v2/alerts) that apply here: another host's
    own halt of this very crash and environment, begun within `window_s` before `now` (not
    after it), and kept alive by its daemon: Alertmanager's own `updatedAt` (set when it
    last received the alert, which a halted host's daemon re-sends every `resend_s`) within
    FRESH_S. So a proof posted once with a start in 2099 proves nothing for long. Anything else
    in the reply (other alerts, malformed ones) is passed over; never raises."""
    if not isinstance(body, list):
        return []
    found: list[FleetProof] = []
    for alert in body[:MAX_PROOFS]:
        proof = _proof(alert)
        updated = _time(alert.get("updatedAt")) if isinstance(alert, dict) else None
        if (
            proof is not None
            and proof.crash == crash
            and proof.environment == environment
            and proof.host != not_host
            and now - window_s <= proof.since_s <= now + CLOCK_SKEW_S
            and updated is not None
            and now - FRESH_S <= updated <= now + CLOCK_SKEW_S
        ):
            found.append(proof)
    return sorted(found, key=lambda p: (p.since_s, p.host))


def _proof(alert: object) -> FleetProof | None:
    """One alert of the reply as a proof; None when it is not a well-formed active own proof."""
    if not isinstance(alert, dict):
        return None
    labels, annotations = alert.get("labels"), alert.get("annotations")
    # A silenced proof is still one: a silence quiets the page, `release` withdraws the proof.
    if not isinstance(labels, dict):
        return None
    if labels.get("alertname") != FLEET_ALERT or labels.get("proof") != PROOF_OWN:
        return None
    crash, environment = _label(labels, "crash", _HEX), _label(labels, "environment", _HEX)
    host, unit = _label(labels, "host", _NAME), _label(labels, "unit", _NAME)
    if crash is None or environment is None or host is None or unit is None:
        return None
    since = _time(alert.get("startsAt"))
    if since is None:
        return None
    crashes = whole_number(
        _int_text(annotations.get("crashes")) if isinstance(annotations, dict) else None
    )
    return FleetProof(
        host=host,
        unit=unit,
        crash=crash,
        environment=environment,
        since_s=since,
        crashes=crashes if crashes > 0 else None,
    )


def _label(labels: Mapping[str, Any], name: str, shape: re.Pattern[str]) -> str | None:
    value = labels.get(name)
    return value if isinstance(value, str) and shape.fullmatch(value) else None


def _time(value: object) -> float | None:
    """An RFC 3339 time as Alertmanager writes it (nanoseconds, `Z`); None for anything else."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    text = value.replace("Z", "+00:00")
    # Python before 3.11 reads at most microseconds: Alertmanager may print nanoseconds.
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    try:
        return at.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _int_text(value: object) -> int | None:
    if isinstance(value, str) and value.isdigit() and len(value) <= 6:
        return int(value)
    return None
