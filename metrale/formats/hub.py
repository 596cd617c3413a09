"""What to say when a model path that does not exist looks like a Hugging Face Hub id.

metrale loads local checkpoints only (no network at load time). `hub_hint("Org/name")`
gives the download command for it: `hf download`, the command line that the
`huggingface_hub` package installs (its older `huggingface-cli` is gone from
huggingface_hub 1.0 on). Both `metrale.load` (FormatError) and the command line (exit 2) add
it to their "no such file or directory" message.
"""
from __future__ import annotations

import re

# owner/name as the Hub spells them: letters, digits, "-", "_", "." (no leading dot)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_hint(text: str) -> str:
    """Advice for a missing path that looks like a Hugging Face Hub id ("" otherwise)."""
    if not HUB_ID.fullmatch(str(text)):
        return ""
    name = str(text).split("/")[-1]
    return (f"; metrale loads local checkpoint directories only, and {text!r} looks like a "
            f"Hugging Face Hub id: download it first with hf download {text} "
            f"--local-dir {name} (pip install huggingface_hub), then pass {name}")
