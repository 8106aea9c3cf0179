"""Synthetic text of a given approximate token length, without a tokenizer.

Called by :mod:`tandem_loadtest.workloads`; calls numpy only.

Each word below is a single token (with its leading space) in the common BPE
vocabularies (GPT-2 family, Llama, SmolLM), so N words is about N tokens.
The true counts come back in each response's ``usage`` and those are the
ones the report uses.
"""

from __future__ import annotations

import numpy as np

_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this be or had not "
    "but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made team season well under game series while "
    "through film three government because war called both between since year people area north south "
    "west east part group music member system early around high number life until work own name river "
    "back also line main house long water family before book play radio town road party small large old "
    "next best four five six seven eight nine ten day week month market power field church local great "
    "public station center head left right red green blue black white light story model point order place "
    "plan level paper page table value price cost rate share data report "
)
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())


def words(rng: np.random.Generator, num_words: int) -> str:
    """``num_words`` random words joined by spaces (about as many tokens)."""
    if num_words <= 0:
        return ""
    idx = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in idx)
