"""Scenario 11: the main process dies mid-epoch (SIGKILL, SIGTERM, uncaught exception, os._exit):
no orphan worker, no /dev/shm entry left. Run: python s11_kill.py (drives itself)."""

import os
import signal
import subprocess
import sys
import time

CHILD = r'''
import os, signal, sys, numpy as np
sys.path.insert(0, %r)
from s1_h5py import Lazy, make_file
from arena_loader import ArenaLoader
from torch.utils.data import DataLoader
path = os.path.join(%r, "k.h5"); make_file(path)
cls = ArenaLoader if sys.argv[1] == "a" else DataLoader
loader = cls(Lazy(path), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True)
it = iter(loader); held = next(it); next(it)
print("PIDS", os.getpid(), flush=True)
how = sys.argv[2]
if how == "kill": os.kill(os.getpid(), signal.SIGKILL)
if how == "term": os.kill(os.getpid(), signal.SIGTERM)
if how == "exit": os._exit(3)
if how == "raise": raise RuntimeError("user bug")
'''


def descendants_of_gone(pid_marker):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if pid_marker.encode() in f.read():
                        out.append(int(p))
            except OSError:
                pass
    return out


if __name__ == "__main__":
    import tempfile
    d = tempfile.mkdtemp()
    code = CHILD % (os.path.dirname(os.path.abspath(__file__)), d)
    for which in ("t", "a"):
        for how in ("kill", "term", "exit", "raise"):
            before = set(os.listdir("/dev/shm"))
            marker = f"trial13-{which}-{how}"
            p = subprocess.run([sys.executable, "-c", code, which, how, marker], capture_output=True, text=True,
                               timeout=60)
            time.sleep(2)
            left = descendants_of_gone(marker)
            shm = sorted(set(os.listdir("/dev/shm")) - before)
            print(f"[11 {'torch' if which == 't' else 'arena'} main dies by {how}] rc={p.returncode} "
                  f"orphans={left} new_shm={shm}", flush=True)
            for q in left:
                os.kill(q, signal.SIGKILL)
