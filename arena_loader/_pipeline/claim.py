"""A session's hold on the loader's slab (docs/design.md, "Slot budget").

Before the first batch the slot size is unknown: workers start with a *reserved* slab (a
shared-memory object with no size yet) and the first batch sizes it (``attach``), which is
when the loader's arena exists. Later sessions claim that arena at once. With no room in
``/dev/shm`` for the slab, batches go to one-off segments (``slabless``), as torch's do.
Each change of hold is one statement, so an interrupt never leaves a claim unrecorded.
"""

from __future__ import annotations

from .._arena import Arena, ArenaSource, slot_budget
from .._pool import Waker
from .._slab import Slab
from ..errors import ShmCapacityError


class SlabClaim:
    __slots__ = ("_source", "_waker", "arena", "claimed", "reserve", "slabless")

    def __init__(self, source: ArenaSource, waker: Waker):
        self._source = source
        self._waker = waker  # freed slots wake the session's waiting next()
        self.arena: Arena | None = None
        self.claimed = False
        self.reserve: Slab | None = None
        self.slabless = False  # /dev/shm had no room for the slab: a segment per batch

    def begin(self) -> None:
        """Claim the loader's arena if its size is known, else reserve a slab (idempotent)."""
        if self.arena is not None or self.reserve is not None:
            return
        try:
            # None until the first batch sets the budget. One statement: a claim is never
            # left unrecorded (it would keep the loader's arena from later sessions).
            self.arena, self.claimed = (arena := self._source.claim()), arena is not None
        except ShmCapacityError:
            arena, self.slabless = None, True
        if arena is not None:
            arena.pool.waker = self._waker
        else:
            self.reserve = Slab.reserve()

    def for_workers(self) -> tuple[Slab, int]:
        """The slab workers start with, and its slot size (0: reserved, sized later)."""
        if self.arena is not None:
            return self.arena.slab, self.arena.slot_nbytes
        return self.reserve, 0

    def attach(self, first_nbytes: int) -> bool:
        """The first batch sets the slot budget: the reserved slab becomes the arena's,
        sized for it. False when /dev/shm has no room (batches go to segments)."""
        if self.arena is None:
            try:
                # One statement: the reserve the workers hold becomes the arena's slab, and
                # an interrupt cannot leave the session with neither (or a claim unrecorded).
                self.arena, self.claimed, self.reserve = self._source.claim(
                    slot_budget(first_nbytes), slab=self.reserve), True, None
            except ShmCapacityError:
                # No room for `slots` batches at once: go on with a segment per batch, which
                # is all torch needs; a batch that does not fit either is that batch's error.
                self.slabless = True
                return False
        self.arena.pool.waker = self._waker
        return True

    def release(self) -> None:
        """Give the arena back to the loader (idempotent); every slot must be free or
        reclaimed by now."""
        if not self.claimed:
            return
        self.claimed = False
        self.arena.pool.waker = None
        self._source.unclaim(self.arena)

    def let_go(self) -> None:
        """After ``release``: the next ``begin`` claims the loader's arena afresh."""
        if not self.claimed:
            self.arena = None

    def close(self) -> None:
        """After ``release``: a slab still only reserved (no batch came) is closed."""
        reserve, self.reserve = self.reserve, None
        if reserve is not None:
            reserve.close()
