"""The broker configuration shown in README.md loads and builds a broker (docs must not rot)."""

from __future__ import annotations

from pathlib import Path

from libra.broker.state import BrokerConfig, BrokerState
from libra.config import load_section


def test_readme_broker_config_example_loads(tmp_path) -> None:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("```toml\n") + len("```toml\n")
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text[start : text.index("```", start)])
    state = BrokerState(load_section(cfg, "broker", BrokerConfig))
    assert state.actions is not None and state.actions.name == "tangram"
    assert [b.name for b in state.rollout.buckets] == ["short", "long"]
