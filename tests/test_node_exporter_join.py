"""The join deploy/README.md shows between our metrics (label `unit`, scraped on :9464) and
node_exporter's systemd collector (label `name`, scraped on :9100), run by promtool on series
shaped as the two exporters write them: the expression is read from the README itself, so the
page cannot show a query that does not work.

Was: the README did not say how the two label the same unit, nor how to join them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_README = ROOT / "deploy" / "README.md"
STATES = ("active", "activating", "deactivating", "inactive", "failed")  # node_exporter's

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("promtool") is None, reason="needs promtool (Debian prometheus)"
    ),
]


def readme_join() -> str:
    """The one PromQL block of deploy/README.md's section on node_exporter."""
    text = DEPLOY_README.read_text(encoding="utf-8")
    section = text.partition("#### Joining node_exporter's systemd collector")[2]
    assert section, "deploy/README.md has no section on joining node_exporter"
    blocks = re.findall(r"```promql\n(.*?)```", section.partition("\n#")[0], flags=re.DOTALL)
    assert len(blocks) == 1, blocks
    return str(blocks[0])


def node_unit_state(host: str, unit: str, state: str) -> list[dict[str, str]]:
    """node_systemd_unit_state of one unit: 1 for its state, 0 for every other."""
    return [
        {
            "series": f'node_systemd_unit_state{{instance="{host}:9100",job="node",'
            f'name="{unit}",state="{s}",type="simple"}}',
            "values": "1 1" if s == state else "0 0",
        }
        for s in STATES
    ]


def halted(host: str, unit: str, value: int) -> dict[str, str]:
    return {
        "series": f'vllm_supervisor_unit_halted{{instance="{host}:9464",'
        f'job="vllm-supervisor",unit="{unit}"}}',
        "values": f"{value} {value}",
    }


def joined(host: str, unit: str, state: str) -> dict[str, object]:
    """A result sample: the supervisor's series with node_exporter's `state` added."""
    labels = f'host="{host}",instance="{host}:9464",job="vllm-supervisor",name="{unit}",'
    return {"labels": f'{{{labels}state="{state}",unit="{unit}"}}', "value": 1}


def test_the_readme_join_gives_each_halted_unit_its_systemd_state(tmp_path: Path) -> None:
    """Halted units get the state systemd reports for them on the same host (a halt that held
    is inactive or failed; active would mean it did not); a unit not halted, a host without
    a supervisor and the same unit name on another host stay out."""
    series = [
        halted("gpu-1", "vllm.service", 1),
        *node_unit_state("gpu-1", "vllm.service", "inactive"),
        halted("gpu-1", "sglang.service", 0),
        *node_unit_state("gpu-1", "sglang.service", "active"),
        halted("gpu-2", "vllm.service", 1),
        *node_unit_state("gpu-2", "vllm.service", "failed"),
        *node_unit_state("gpu-2", "sglang.service", "active"),
        *node_unit_state("gpu-3", "vllm.service", "activating"),
    ]
    case = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": readme_join(),
                        "eval_time": "1m",
                        "exp_samples": [
                            joined("gpu-1", "vllm.service", "inactive"),
                            joined("gpu-2", "vllm.service", "failed"),
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "join_test.yml"
    path.write_text(json.dumps(case), encoding="utf-8")  # JSON is valid YAML
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
