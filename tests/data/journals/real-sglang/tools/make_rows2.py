"""Batch 2 of make_rows.py: write NN-slug.export.xz (to OUT), NNN-real-sglang-slug.log (to
CORPUS) and INDEX-rows.tsv (INDEX.tsv's 12 columns), checking every root_cause_key against its
log and every `ended` against PID 1's line for the first invocation.

Usage: python3 -B make_rows2.py ROWS2.tsv CORPUS OUT INDEX_ROWS OUTDIR...
ROWS2.tsv: scenario, key, phase, served_s, ended, notes (tab-separated, no header); the number
is 520 + (NN - 17); the label comes from run_sglang2.py's LABELS.
"""

import json
import lzma
import re
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_rows import VERSION  # noqa: E402
from run_sglang2 import LABELS  # noqa: E402

HEADER = ["file", "expected_severity", "root_cause_key", "class", "source_url", "version",
          "notes", "engine", "phase", "served_s", "ended", "source"]


def ended_of(info: dict) -> str:
    first = info["invocations"][0]
    for e in info["pid1"]:
        m = re.search(r"Main process exited, code=(exited|killed), status=(\d+)",
                      e["MESSAGE"] or "")
        if m and e.get("INVOCATION_ID") in (first, None):
            return f"{m.group(1)}:{m.group(2)}"
    raise AssertionError("no exit line for the first invocation")


def main() -> None:
    rows = [r.split("\t") for r in Path(sys.argv[1]).read_text().splitlines() if r.strip()]
    corpus, outx, index = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    outdirs = [Path(d) for d in sys.argv[5:]]
    lines = ["\t".join(HEADER)]
    for scenario, key, phase, served_s, ended, notes in rows:
        src = next(d for d in outdirs if (d / f"{scenario}.log").exists())
        nn = int(scenario.split("-", 1)[0])
        slug = scenario.split("-", 1)[1]
        name = f"{520 + nn - 17}-real-sglang-{slug}.log"
        text = (src / f"{scenario}.log").read_bytes()
        assert key.encode() in text, (scenario, key)
        assert "\t" not in notes and "\n" not in notes
        info = json.loads((src / "work" / f"{scenario}.info.json").read_text())
        assert ended_of(info) == ended, (scenario, ended_of(info), ended)
        (corpus / name).write_bytes(text)
        (outx / f"{scenario}.export.xz").write_bytes(
            lzma.compress((src / f"{scenario}.export").read_bytes()))
        severity, expected, reason = LABELS[scenario]
        row = {"file": name, "expected_severity": severity, "root_cause_key": key, "class": "",
               "source_url": "recorded on this project's test host: "
                             f"tests/data/journals/real-sglang/{scenario}.export.xz",
               "version": VERSION,
               "notes": f"SGLANG BATCH 2 HOLD-OUT. Label {severity} before recording: {reason} "
                        f"(cause expected: {expected}). {notes}",
               "engine": "sglang", "phase": phase, "served_s": served_s, "ended": ended,
               "source": ""}
        lines.append("\t".join(row[h] for h in HEADER))
    index.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
