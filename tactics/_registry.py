"""The tactics by name: the one list of them, read by error messages and by the command
line's schedule words."""

from __future__ import annotations

from functools import partial

from ._context import ContextParallel
from ._data import DataParallel
from ._expert import ExpertParallel
from ._manual import Replicate, Shard, Specs
from ._megatron import Megatron
from ._pipeline import Pipeline
from ._remat import Remat
from ._sequence import SequenceParallel
from ._zero import FSDP, ZeRO

#: Every tactic class, in the order a schedule usually lists them.
TACTICS = (Shard, Replicate, Specs, DataParallel, FSDP, ZeRO, Megatron, SequenceParallel, ContextParallel, ExpertParallel,
           Pipeline, Remat)

#: Schedule words (`WORD:AXIS` in `automap search --schedule`) -> the tactic they make on
#: one mesh axis.
WORDS = {"dp": DataParallel, "fsdp": FSDP, "zero1": partial(ZeRO, stage=1), "zero2": partial(ZeRO, stage=2),
         "zero3": partial(ZeRO, stage=3), "megatron": Megatron, "sp": SequenceParallel, "cp": ContextParallel,
         "ep": ExpertParallel}


def tactic_names() -> str:
    """The tactic classes' names, for a message that lists them."""
    return ", ".join(t.__name__ for t in TACTICS)
