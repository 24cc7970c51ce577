"""What a failed preflight check reports: a signature's id, title and remediation, from the table.

A check names the signature its crash would match (environment.preflight); the words are the
table's, so a preflight failure and the crash it predicts say the same thing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..environment.preflight import Identity, Lookup
from ..errors import SupervisorError
from .signatures import Signature, SignatureTable, load_signature_table


def identities(table: SignatureTable | None) -> Lookup:
    """The identity a failed preflight check reports for a signature id, in the words of
    `table` (the config's), else of the shipped table, which holds every id a check names (a
    table of one's own may lack them; None is a table that did not load). A remediation the
    first lacks comes from the second."""
    shipped: list[SignatureTable] = []  # loaded once, when first needed

    def candidates(signature_id: str) -> Iterator[Signature]:
        own = table.get(signature_id) if table is not None else None
        if own is not None:
            yield own
            if own.remediation:
                return
        if not shipped:
            try:
                shipped.append(load_signature_table())
            except SupervisorError:
                return  # the id's own words are all there is left
        if (found := shipped[0].get(signature_id)) is not None:
            yield found

    def lookup(signature_id: str, captures: Mapping[str, str]) -> Identity:
        found = list(candidates(signature_id))
        if not found:
            return Identity(signature=signature_id, title=signature_id, remediation="")
        remediations = (s.render_remediation(captures) for s in found)
        return Identity(
            signature=signature_id,
            title=found[0].title,
            remediation=next((r for r in remediations if r), ""),
            severity=str(found[0].severity),
        )

    return lookup
