"""Case 6: the kernel restarted (restart_kernel(now=True)) or shut down while persistent
workers live, while an epoch is mid-way, while a batch is held: every process of the old kernel
gone 5 s later, no /dev/shm name left."""

from common import Case, Cell, Count, Restart, Shutdown, main

MID_EPOCH = "loader = make()\nit = iter(loader)\nprint(show(next(it)))\nprint(show(next(it)))"
EPOCH = "print([b['y'].tolist() for b in loader])"
HELD = "loader = make()\nbatches = list(loader)\nb = next(iter(loader))\nprint(show(b))"
SLOW = "loader = make(Squares(sleep_s=0.05))\nit = iter(loader)\nprint(show(next(it)))"

CASES = [
    Case("restart-idle-loader", [Cell(MID_EPOCH.split("\nit")[0] + "\n" + EPOCH), Restart(),
                                 Cell("loader = make()\n" + EPOCH)]),
    Case("restart-mid-epoch", [Cell(MID_EPOCH), Count("mid"), Restart(),
                               Cell("loader = make()\n" + EPOCH)]),
    Case("restart-holding-batches", [Cell(HELD), Restart(), Cell("loader = make()\n" + EPOCH)]),
    Case("restart-slow-in-flight", [Cell(SLOW), Restart(), Cell("loader = make()\n" + EPOCH)]),
    Case("restart-twice", [Cell(MID_EPOCH), Restart(), Cell(MID_EPOCH), Restart(),
                           Cell(MID_EPOCH)]),
    Case("shutdown-mid-epoch", [Cell(MID_EPOCH), Shutdown()]),
    Case("shutdown-holding-batches", [Cell(HELD), Shutdown()]),
    Case("shutdown-slow-in-flight", [Cell(SLOW), Shutdown()]),
]

if __name__ == "__main__":
    main(CASES)
