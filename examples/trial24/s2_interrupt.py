"""Case 2: the kernel interrupted (SIGINT to its process group, as the notebook's button sends
it) while a cell iterates slowly, then a cell that continues the same iterator and one that
starts a new epoch."""

from common import Case, Cell, Count, Interrupt, main

SETUP = "loader = make(Squares(sleep_s={sleep_s}))\nit = iter(loader)\nseen = []"
LOOP = "for b in it:\n    seen.append(b['y'].tolist())"
REPORT = '''flat = sum(seen, [])
print(seen)
print(len(seen), "batches,", len(flat), "samples, lost", sorted(set(range(20)) - set(flat)),
      "repeated", sorted({i for i in flat if flat.count(i) > 1}))'''
NEW_EPOCH = "print([b['y'].tolist() for b in loader])"


def interrupted(name: str, sleep_s: float, body: str, after_s: float) -> Case:
    return Case(name, [
        Cell(SETUP.format(sleep_s=sleep_s)),
        Interrupt(LOOP + body, after_s),
        Count("interrupted"),
        Cell(LOOP),      # the same iterator, continued
        Cell(REPORT),
        Cell(NEW_EPOCH),
        Count("new-epoch", 0.5),
    ])


CASES = [
    # __getitem__ sleeps 0.1 s: the interrupt lands in next() (in a worker's sleep with workers)
    interrupted("interrupt-in-next", 0.1, "", 1.1),
    # the loop body sleeps: the interrupt lands in the body, the next batch ready or in flight
    interrupted("interrupt-in-body", 0.0, "\n    time.sleep(0.3)", 1.0),
    Case("interrupt-twice", [  # interrupted, continued, interrupted again, continued
        Cell(SETUP.format(sleep_s=0.05)),
        Interrupt(LOOP, 0.5),
        Interrupt(LOOP + "\n    time.sleep(0.2)", 0.5),
        Cell(LOOP),
        Cell(REPORT),
        Cell(NEW_EPOCH),
    ]),
    Case("interrupt-list", [  # batches = list(loader) interrupted, then run again
        Cell("loader = make(Squares(sleep_s=0.1))"),
        Interrupt("batches = list(loader)", 1.0),
        Cell("batches = list(loader)\nprint([b['y'].tolist() for b in batches])"),
    ]),
    Case("interrupt-iter-loop", [  # iter() / next() made over and over: the interrupt lands
        Cell("loader = make()"),    # anywhere, iter()'s worker start included
        Interrupt("for i in range(100000):\n    it = iter(loader)\n    b = next(it)", 1.5),
        Count("interrupted", 1.0),
        Cell("print(sorted(sum([b['y'].tolist() for b in loader], [])) == list(range(20)))"),
        Count("epoch", 1.0),
    ]),
    Case("interrupt-spawn-start", [  # spawned workers still importing torch (the SIGINT
        Cell("from nbdata import Squares as ModuleSquares\n"  # reaches them too)
             "loader = make(ModuleSquares(sleep_s=0.05), multiprocessing_context='spawn')"),
        Interrupt("it = iter(loader)\nprint(next(it)['y'].tolist())", 0.7),
        Count("interrupted", 1.0),
        Cell("print([b['y'].tolist() for b in loader])"),
        Count("epoch", 1.0),
    ], configs=((2, False), (2, True))),
]

if __name__ == "__main__":
    main(CASES)
