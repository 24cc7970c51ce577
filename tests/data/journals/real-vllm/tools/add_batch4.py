"""Batch 4 (hold-outs): like add_batch2.py, but writes under /tmp/batch4 (copied into the repository
afterwards, unchanged).
For each row of ROWS.tsv (scenario, severity, key, phase, served_s, ended, notes): the first
invocation's log as corpus/5XX-real-vllm-SLUG.log (5XX = 500 + NN - 72; 401-415 are taken), the unit's whole journal
as out/NN-SLUG.export.xz, and a row in INDEX-rows.tsv in INDEX.tsv's column order (the key must be
in the log).

Usage: python3 add_batch4.py ROWS.tsv OUTDIR...
"""

import lzma
import sys
from pathlib import Path

from add_batch2 import VERSION  # the same venv's versions as batches 2 and 3

B4 = Path("/tmp/batch4")
HEADER = ("file expected_severity root_cause_key class source_url version notes engine phase "
          "served_s ended source").split()


def main() -> None:
    rows = [r.split("\t") for r in Path(sys.argv[1]).read_text().splitlines() if r.strip()]
    outdirs = [Path(d) for d in sys.argv[2:]]
    out_rows = []
    for scenario, severity, key, phase, served_s, ended, notes in rows:
        src = next(d for d in outdirs if (d / f"{scenario}.log").exists())
        number, slug = scenario.split("-", 1)
        name = f"{500 + int(number) - 72}-real-vllm-{slug}.log"  # 400-415 are taken in the corpus
        text = (src / f"{scenario}.log").read_bytes()
        if key:
            assert key.encode() in text, (scenario, key)
        assert "\t" not in notes and "\n" not in notes
        assert notes.startswith("BATCH 4 HOLD-OUT.")
        (B4 / "corpus" / name).write_bytes(text)
        export = B4 / "out" / f"{scenario}.export.xz"
        export.write_bytes(lzma.compress((src / f"{scenario}.export").read_bytes()))
        row = {
            "file": name, "expected_severity": severity, "root_cause_key": key, "class": "",
            "source_url": "recorded on this project's test host: "
            f"tests/data/journals/real-vllm/{export.name}",
            "version": VERSION, "notes": notes, "engine": "vllm", "phase": phase,
            "served_s": served_s, "ended": ended, "source": "",
        }
        out_rows.append("\t".join(row[h] for h in HEADER))
    (B4 / "INDEX-rows.tsv").write_text("\n".join(out_rows) + "\n", encoding="utf-8")
    print(len(out_rows), "rows")


if __name__ == "__main__":
    main()
