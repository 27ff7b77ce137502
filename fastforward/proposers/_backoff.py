"""Back-off for drafters that keep caches in step (``fasteagle``, ``falcon``): keeping a drafter's cache current costs
a pass every step, which a step that then drafts nothing does not earn back. After a look whose best choice was to
draft nothing, skip looking for 1, 2, 4, ... up to ``limit`` steps (the proposer commits the skipped steps' accepted
rows together at the next look: r rows cost about what one does). Drafting resets it. Only which steps draft
changes, never the output."""

from __future__ import annotations


class BackOff:
    def __init__(self, limit: int):
        self.limit = limit
        self.skip = 0  # steps left to skip looking
        self.idle = 0  # consecutive looks that drafted nothing

    def skipping(self) -> bool:
        """True (and count the step) while steps are left to skip."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def drafted(self) -> None:
        self.idle = 0

    def drafted_nothing(self) -> None:
        if self.limit:
            self.skip = min(2**self.idle, self.limit)
            self.idle += 1
