"""The README's method table (issue 18 item 11) covers the pointer API exactly: every
public method of the `Model` mixins appears in it, and every Python name it gives exists."""
import re
from pathlib import Path

from metrale.model_engine import (ModelAdapters, ModelCircuit, ModelDeviceFeed, ModelDraft,
                                  ModelEp, ModelForward, ModelLifecycle, ModelLogits,
                                  ModelSsmState, ModelStreams, ModelVerify, TransformerModel)

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
MIXINS = (ModelLogits, ModelForward, ModelLifecycle, ModelVerify, ModelStreams, ModelDraft,
          ModelAdapters, ModelSsmState, ModelEp, ModelDeviceFeed, ModelCircuit)


def table_rows():
    start = README.index("### Method table")
    rows = []
    for line in README[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| `") or line.startswith("| —"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def names(cell):
    return re.findall(r"`([A-Za-z_][\w.:]*)", cell)


def test_every_mixin_method_is_in_the_table():
    listed = set()
    for rust, py, _ in table_rows():
        listed.update(n.split(".")[-1] for n in names(rust) + names(py))
    public = {n for cls in MIXINS for n in vars(cls) if not n.startswith("_")
              and callable(getattr(cls, n))}
    assert public - listed == set(), f"missing from the README table: {sorted(public - listed)}"


def test_every_python_name_in_the_table_exists():
    missing = []
    for rust, py, diff in table_rows():
        if py == "—" or "not mirrored" in diff:
            continue
        for n in names(py) or names(rust):
            if "." in n or "::" in n:
                continue
            if not hasattr(TransformerModel, n):
                missing.append(n)
    assert missing == []


def test_readme_states_how_long_a_logits_pointer_lives():
    assert "valid until the next forward pass on that model" in README
    assert "logits_to_numpy(ptr, n=1)" in README
