"""Cases 1 and 4: the dataset class defined in the notebook (the kernel's ``__main__``) with
fork, spawn and forkserver workers; the class redefined or patched in a later cell and the
loader cell run again."""

from common import Case, Cell, main

EPOCH = "for b in loader:\n    print(show(b))"
REDEFINED = '''
class Squares(Dataset):
    """Redefined: y is 100 + i, x is -i."""
    def __init__(self, n=20, sleep_s=0.0):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return {"x": torch.full((3,), float(-i)), "y": 100 + i}
'''


def context_case(context: str) -> Case:
    return Case(f"main-class-{context}", [
        Cell(f"loader = make(multiprocessing_context={context!r})"),
        Cell(EPOCH),
        Cell(EPOCH),  # the same cell run again after the error
        # the fix: the class moved to a module file (nbdata.py, on the kernel's path)
        Cell("from nbdata import Squares as ModuleSquares\n"
             f"loader = make(ModuleSquares(), multiprocessing_context={context!r})\n" + EPOCH),
    ])


CASES = [
    Case("main-class-fork", [Cell("loader = make()"), Cell(EPOCH), Cell(EPOCH)]),
    context_case("spawn"),
    context_case("forkserver"),
    Case("redefine-class", [
        Cell("loader = make()\nprint(show(next(iter(loader))))"),
        Cell(REDEFINED),
        Cell("loader = make()\n" + EPOCH),
    ]),
    Case("redefine-class-old-loader", [  # the loader built before the redefinition kept
        Cell("loader = make()\nprint(show(next(iter(loader))))"),
        Cell(REDEFINED),
        Cell(EPOCH),
    ]),
    Case("patch-method-live-workers", [  # a method patched while persistent workers live
        Cell("loader = make()\nprint(show(next(iter(loader))))"),
        Cell("Squares.__getitem__ = lambda self, i: {'x': torch.zeros(3), 'y': -i}"),
        Cell(EPOCH),
        Cell(EPOCH),
    ]),
]

if __name__ == "__main__":
    main(CASES)
