"""The GGUF section of the field table (field_table.GGUF) against what gguf/config.py and
gguf/tokenizer.py read: every key a parser touches is listed, every key of the fixtures is
classified, an unlisted key is refused, and every REFUSED entry (and every neutral-only
HONOURED one, given another value) refuses a file carrying it."""
from __future__ import annotations

import pytest

from metrale.errors import Unsupported
from metrale.formats import open_source
from metrale.formats.field_table import GGUF, REFUSED
from metrale.formats.gguf.config import _NEUTRAL, classify, hf_config
from metrale.formats.gguf.file import GGUFFile
from metrale.formats.gguf.tokenizer import build_tokenizer
from tests.formats.gguf_util import GGUF_FIXTURES, rewrite

FILES = ["llama", "qwen2", "qwen3", "spm_tokenizer"]


class Recording(dict):
    def __init__(self, d, log):
        super().__init__(d)
        self.log = log

    def get(self, key, default=None):
        self.log.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.log.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.log.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("name", FILES)
def test_every_key_the_parsers_read_is_in_the_table(name):
    g = GGUFFile(GGUF_FIXTURES / f"{name}.gguf")
    log: set = set()
    if name != "spm_tokenizer":
        hf_config(Recording(g.fields, log), g.tensors, name)
    build_tokenizer(Recording(g.fields, log), name)
    arch = g.fields["general.architecture"]
    assert log
    missing = sorted(k for k in log if classify(k, arch) is None)
    assert not missing, f"read by the parser but not in field_table.GGUF: {missing}"


@pytest.mark.parametrize("name", FILES)
def test_every_key_of_the_fixtures_is_classified(name):
    g = GGUFFile(GGUF_FIXTURES / f"{name}.gguf")
    arch = g.fields["general.architecture"]
    assert all(classify(k, arch) is not None for k in g.fields), \
        [k for k in g.fields if classify(k, arch) is None]


def test_an_unlisted_key_is_refused(monkeypatch, tmp_path):
    """Drop a key the llama fixture holds from the table: the file is refused, naming it."""
    monkeypatch.delitem(GGUF, "general.file_type")
    with pytest.raises(Unsupported, match="'general.file_type' is not understood"):
        open_source(GGUF_FIXTURES / "llama.gguf")


REFUSED_KEYS = sorted(k for k, f in GGUF.items() if f.status == REFUSED)


@pytest.mark.parametrize("entry", REFUSED_KEYS)
def test_refused_entries_refuse(tmp_path, entry):
    key = entry.replace("{arch}", "llama").replace("*", "x")
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "m.gguf", {key: 1})
    with pytest.raises(Unsupported, match=key.replace(".", r"\.")):
        open_source(p)


NON_NEUTRAL = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v + 1.0,
               str: lambda v: v + "-other"}


@pytest.mark.parametrize("entry", sorted(_NEUTRAL))
def test_neutral_only_entries_refuse_other_values(tmp_path, entry):
    key = entry.replace("{arch}", "llama")
    allowed = _NEUTRAL[entry][0]
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "m.gguf",
                {key: NON_NEUTRAL[type(allowed)](allowed)})
    with pytest.raises(Unsupported, match=key.replace(".", r"\.")):
        open_source(p)
    p = rewrite(GGUF_FIXTURES / "llama.gguf", tmp_path / "ok.gguf", {key: allowed})
    open_source(p)   # the neutral value loads
