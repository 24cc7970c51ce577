"""Write the SGLang recordings' files: NN-slug.export.xz, 3NN-real-sglang-slug.log and
INDEX-rows.tsv (the corpus INDEX.tsv's columns), checking every root_cause_key against its log.

Usage: python3 make_rows.py ROWS.tsv DEST OUTDIR...
ROWS.tsv: scenario, number, key, phase, served_s, ended, notes (tab-separated, no header);
the label comes from run_sglang.py's LABELS. OUTDIRs are searched in order for the scenario.
"""

import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_sglang import LABELS  # noqa: E402

HEADER = ["file", "expected_severity", "root_cause_key", "class", "source_url", "version",
          "notes", "engine", "phase", "served_s", "ended"]
VERSION = ("sglang 0.5.23 (PyPI); torch 2.14.1 (CUDA 13 wheel, no GPU); transformers 5.19.0; "
           "CPython 3.11.2; systemd 252.39")


def main() -> None:
    rows = [r.split("\t") for r in Path(sys.argv[1]).read_text().splitlines() if r.strip()]
    dest = Path(sys.argv[2])
    outdirs = [Path(d) for d in sys.argv[3:]]
    lines = ["\t".join(HEADER)]
    for scenario, number, key, phase, served_s, ended, notes in rows:
        src = next(d for d in outdirs if (d / f"{scenario}.log").exists())
        slug = scenario.split("-", 1)[1]
        name = f"{number}-real-sglang-{slug}.log"
        text = (src / f"{scenario}.log").read_bytes()
        assert key.encode() in text, (scenario, key)
        assert "\t" not in notes and "\n" not in notes
        (dest / name).write_bytes(text)
        (dest / f"{scenario}.export.xz").write_bytes(
            lzma.compress((src / f"{scenario}.export").read_bytes()))
        severity, reason = LABELS[scenario]
        row = {"file": name, "expected_severity": severity, "root_cause_key": key, "class": "",
               "source_url": "recorded here", "version": VERSION,
               "notes": f"Label {severity} before recording: {reason}. {notes}",
               "engine": "sglang", "phase": phase, "served_s": served_s, "ended": ended}
        lines.append("\t".join(row[h] for h in HEADER))
    (dest / "INDEX-rows.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
