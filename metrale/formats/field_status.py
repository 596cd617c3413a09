"""The three statuses of a checkpoint field (field_table.py's rule) and their constructors,
shared by field_table.py and the tables kept in modules of their own (quant/fields.py)."""
from __future__ import annotations

from typing import NamedTuple

HONOURED, REFUSED, IRRELEVANT = "honoured", "refused", "irrelevant"


class Field(NamedTuple):
    status: str
    why: str


def honoured(why: str) -> Field:
    return Field(HONOURED, why)


def refused(why: str) -> Field:
    return Field(REFUSED, why)


def irrelevant(why: str) -> Field:
    return Field(IRRELEVANT, why)
