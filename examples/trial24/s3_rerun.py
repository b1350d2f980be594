"""Cases 3 and 5: the loader cell run again and again (the old loader and iterator replaced
while their workers live), counting the kernel's children and /dev/shm names after each; and
batches held across cells while later epochs run."""

from common import Case, Cell, Count, main

RERUNS = 5


def rerun(name: str, cell: str, wait_s: float = 0.5) -> Case:
    steps: list = []
    for i in range(RERUNS):
        steps += [Cell(cell), Count(f"r{i}", wait_s)]
    return Case(name, steps)


CASES = [
    rerun("rerun-iter-next", "loader = make()\nit = iter(loader)\nprint(show(next(it)))"),
    # the cell's last expression is the batch: IPython's Out[n] and _ hold every one shown
    rerun("rerun-display-batch", "loader = make()\nit = iter(loader)\nnext(it)"),
    # the cell's last expression is the iterator: Out[n] holds every iterator, workers and all
    rerun("rerun-display-iterator", "loader = make()\nit = iter(loader)\nnext(it)\nit"),
    rerun("rerun-break", "loader = make()\nfor i, b in enumerate(loader):\n"
                         "    if i == 2:\n        break\nprint(show(b))"),
    rerun("rerun-list-of-loaders", "loaders = [make(seed=s) for s in range(3)]\n"
                                   "its = [iter(x) for x in loaders]\n"
                                   "print([show(next(i)) for i in its])"),
    Case("hold-batches", [
        Cell("loader = make()\nbatches = list(loader)\nsnap = [show(b) for b in batches]\n"
             "print(snap)"),
        Cell("for b in loader:\n    pass"),
        Cell("other = make(seed=1)\nfor b in other:\n    b['x'] += 1000"),
        Cell("print([show(b) for b in batches] == snap)\nprint(show(batches[-1]))"),
    ]),
    Case("hold-displayed-batch", [  # a batch kept through Out / _ only
        Cell("loader = make()\nnext(iter(loader))"),
        Cell("held = _\nsnap = show(held)\nfor e in range(3):\n    for b in loader:\n"
             "        pass"),
        Cell("print(show(held) == snap, show(held))"),
    ]),
]

if __name__ == "__main__":
    main(CASES)
