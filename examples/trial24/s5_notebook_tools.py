"""Case 7: what a notebook wraps a loader in: tqdm.auto / tqdm.notebook progress bars,
``%time`` / ``%%time`` / ``%timeit``, ``display`` of a batch, a batch as a cell's value."""

from common import Case, Cell, main

TQDM_AUTO = '''from tqdm.auto import tqdm
loader = make()
for e in range(2):
    for b in tqdm(loader, desc=f"epoch {e}"):
        print(show(b))'''
TQDM_NOTEBOOK = '''from tqdm.notebook import tqdm
loader = make()
bar = tqdm(loader, total=len(loader))
for i, b in enumerate(bar):
    print(show(b))
    if i == 2:
        break
bar.close()
print([b['y'].tolist() for b in loader])'''

CASES = [
    Case("tqdm-auto", [Cell(TQDM_AUTO)]),
    Case("tqdm-notebook-break", [Cell(TQDM_NOTEBOOK)]),
    Case("time-magics", [
        Cell("loader = make()"),
        Cell("%time ys = [b['y'].tolist() for b in loader]\nprint(ys)"),
        Cell("%%time\nfor b in loader:\n    print(show(b))"),
        Cell("%timeit -n 2 -r 2 for b in loader: pass\nprint('timed')"),
        Cell("print([b['y'].tolist() for b in loader])"),
    ]),
    # a print() in __getitem__: ipykernel forwards a forked child's output to the notebook
    Case("print-in-worker", [
        Cell("class Noisy(Squares):\n    def __getitem__(self, i):\n        print(f'load {i}')\n"
             "        return super().__getitem__(i)\nloader = make(Noisy(8))\n"
             "print([b['y'].tolist() for b in loader])\ntime.sleep(1)"),
        Cell("time.sleep(1)\nprint('next cell')"),
    ], unordered=True),
    Case("display-batch", [
        Cell("loader = make()\nb = next(iter(loader))\ndisplay(b)\ndisplay(b['x'])"),
        Cell("b['y']"),
        Cell("next(iter(loader))"),
        Cell("print([b['y'].tolist() for b in loader])"),
    ]),
]

if __name__ == "__main__":
    main(CASES)
