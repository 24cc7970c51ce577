"""The shipped config/supervisor.toml loads, names real signature sets and documents every key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, UnitConfig, load_config, parse_listen
from vllm_supervisor.journal.export import decode_all
from vllm_supervisor.journal.writer import crashed_invocation
from vllm_supervisor.pipeline import Now, Pipeline

SHIPPED = Path(__file__).resolve().parent.parent / "config" / "supervisor.toml"
SECTIONS = ("journal", "tracker", "state", "slack", "metrics", "systemd", "drift", "signatures")


@pytest.fixture(name="config", scope="module")
def _config() -> Config:
    return load_config(SHIPPED)


class TestShippedConfig:
    def test_three_engines_with_their_own_settings(self, config: Config) -> None:
        """vLLM, SGLang and TGI are supervised by one daemon, each with its own settings."""
        names = [u.name for u in config.units]
        assert names == ["vllm.service", "sglang.service", "tgi.service"]
        assert len({u.signature_sets for u in config.units}) == 3
        assert config.is_dry_run("tgi.service")
        assert not config.is_dry_run("vllm.service")
        assert all(
            u.health_url and u.health_url.startswith("http://127.0.0.1:") for u in config.units
        )

    def test_metrics_listen_on_loopback_by_default(self, config: Config) -> None:
        """Neither the built-in default nor the shipped config exposes /metrics beyond the host."""
        assert parse_listen(Config().metrics.listen)[0] == "127.0.0.1"
        assert parse_listen(config.metrics.listen)[0] == "127.0.0.1"

    def test_signature_sets_exist_in_the_table(self, config: Config) -> None:
        """Every signature set a unit names is a domain of the table, and each subset loads."""
        table = load_table(config)
        for unit in config.units:
            assert set(unit.signature_sets) <= table.domains, unit.name
            assert len(table.subset(unit.signature_sets)) > 0

    def test_engine_sets_match_their_engine(self, config: Config) -> None:
        """Each unit uses its own engine's signatures and not another engine's."""
        engines = {"vllm.service": "vllm", "sglang.service": "sglang", "tgi.service": "tgi"}
        for unit in config.units:
            own = engines[unit.name]
            assert own in unit.signature_sets
            assert not (set(engines.values()) - {own}) & set(unit.signature_sets)

    @pytest.mark.parametrize(
        ("section", "cls"),
        [(None, UnitConfig), *((s, type(getattr(Config(), s))) for s in SECTIONS)],
    )
    def test_every_key_is_shown(self, section: str | None, cls: type) -> None:
        """Every config key appears in the shipped file, set or commented out with an example."""
        text = SHIPPED.read_text(encoding="utf-8")
        if section is not None:
            text = text.split(f"[{section}]\n", 1)[1].split("\n[", 1)[0]
        for f in dataclasses.fields(cls):
            assert re.search(rf"^(# )?{f.name} = ", text, re.MULTILINE), f"{section}.{f.name}"

    def test_one_pipeline_applies_each_units_settings(self, config: Config) -> None:
        """The same crash is classified with each unit's own signature sets and dry-run setting."""
        crash = (
            "RuntimeError: flashinfer-cubin version (0.6.3) does not match "
            "flashinfer version (0.6.4)."
        )
        pipeline = Pipeline(config, load_table(config))
        outcomes = {}
        for unit in ("vllm.service", "tgi.service"):
            raw = [
                {b"__CURSOR": b"c%d" % i, b"__REALTIME_TIMESTAMP": b"%d" % (i + 1)}
                | {k.encode(): str(v).encode() for k, v in fields.items()}
                for i, fields in enumerate(crashed_invocation(unit, [crash]))
            ]
            ended = pipeline.feed(decode_all(raw)) + pipeline.due(Now(journal_us=1 << 62))
            [outcome] = pipeline.decide_all(ended)
            outcomes[unit] = outcome
        assert outcomes["vllm.service"].verdict.signature == "flashinfer_cubin_mismatch"
        assert not outcomes["vllm.service"].decision.dry_run
        assert outcomes["tgi.service"].verdict.signature != "flashinfer_cubin_mismatch"
