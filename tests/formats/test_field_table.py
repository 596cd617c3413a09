"""The field table (metrale/formats/field_table.py) against what the parsers read: every
fixture and preset is parsed from a config that records each key touched, and each key
must be listed in the table of its scope. A parser that starts reading a new field fails
here until the table says what the field does and how metrale honours or refuses it."""
from __future__ import annotations

import json

import pytest

from metrale.formats import PRESETS, ModelMetadata, preset_config
from metrale.formats.field_table import (FIELD_TABLE, HONOURED, IRRELEVANT, REFUSED,
                                         field_counts)
from tests.model.common import FIXTURES

_NESTED_SCOPES = ("text_config", "vision_config", "rope_parameters", "rope_scaling")


class Recording(dict):
    """A config dict that records (scope, key) for every key read; nested configs record
    under their own scope."""

    def __init__(self, d: dict, scope: str, log: set) -> None:
        super().__init__(d)
        self.scope, self.log = scope, log

    def _wrap(self, key, value):
        if isinstance(value, dict) and key in _NESTED_SCOPES:
            if key in ("rope_parameters", "rope_scaling"):
                scope = "rope"
            elif key == "text_config":
                scope = value.get("model_type", "llama")
            else:
                scope = value.get("model_type", "clip_vision_model")
            return Recording(value, scope, self.log)
        return value

    def get(self, key, default=None):
        self.log.add((self.scope, key))
        return self._wrap(key, super().get(key, default))

    def __getitem__(self, key):
        self.log.add((self.scope, key))
        return self._wrap(key, super().__getitem__(key))

    def __contains__(self, key):
        self.log.add((self.scope, key))
        return super().__contains__(key)


def _configs():
    out = []
    for d in sorted(p for p in FIXTURES.iterdir() if (p / "config.json").is_file()):
        gen = d / "generation_config.json"
        out.append(pytest.param(json.loads((d / "config.json").read_text()),
                                json.loads(gen.read_text()) if gen.is_file() else None,
                                id=d.name))
    for name in PRESETS:
        cfg, gen = preset_config(name)
        out.append(pytest.param(cfg, gen, id=f"preset:{name}"))
    return out


def read_keys(config: dict, gen: dict | None) -> set:
    log: set = set()
    ModelMetadata.from_config(Recording(config, config["model_type"], log),
                              None if gen is None else Recording(gen, "generation_config", log),
                              source="config.json")
    return log


@pytest.mark.parametrize("config, gen", _configs())
def test_every_field_the_parser_reads_is_in_the_table(config, gen):
    log = read_keys(config, gen)
    assert log, "nothing recorded: the recording config is not reaching the parser"
    missing = sorted(f"{scope}.{key}" for scope, key in log
                     if key not in FIELD_TABLE.get(scope, {}))
    assert not missing, f"read by the parser but not in formats/field_table.py: {missing}"


def test_the_check_fails_for_an_unlisted_field(monkeypatch):
    """The test above can fail: drop one field the llama parser reads from the table."""
    cfg, gen = preset_config("tiny")
    table = dict(FIELD_TABLE["llama"])
    del table["rms_norm_eps"]
    monkeypatch.setitem(FIELD_TABLE, "llama", table)
    log = read_keys(cfg, gen)
    assert ("llama", "rms_norm_eps") in log and "rms_norm_eps" not in FIELD_TABLE["llama"]


def test_every_entry_is_classified_and_explained():
    for scope, table in FIELD_TABLE.items():
        for key, f in table.items():
            assert f.status in (HONOURED, REFUSED, IRRELEVANT), (scope, key)
            assert f.why.strip(), (scope, key)
    counts = field_counts()
    assert all(sum(c.values()) == len(FIELD_TABLE[s]) for s, c in counts.items())


def test_fixture_configs_hold_only_listed_keys():
    """Every key transformers wrote into the fixtures' config.json is classified (the
    fixtures are HF's own output, so a key HF starts saving shows up here)."""
    for d in sorted(p for p in FIXTURES.iterdir() if (p / "config.json").is_file()):
        cfg = json.loads((d / "config.json").read_text())
        scopes = [(cfg["model_type"], cfg)]
        if isinstance(cfg.get("text_config"), dict):
            scopes.append((cfg["text_config"].get("model_type", "llama"), cfg["text_config"]))
        if isinstance(cfg.get("vision_config"), dict):   # llava's CLIP, or a skipped tower
            v = cfg["vision_config"]
            scopes.append((v.get("model_type", "clip_vision_model") if cfg["model_type"] !=
                           "llava" else "clip_vision_model", v))
        for scope, c in scopes:
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            extra = {f"{scope}.{k}" for k in c if k not in FIELD_TABLE[scope]}
            extra |= {f"rope.{k}" for k in rope if k not in FIELD_TABLE["rope"]}
            assert not extra, f"{d.name}: {sorted(extra)} not in formats/field_table.py"
