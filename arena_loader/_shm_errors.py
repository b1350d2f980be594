"""What creating, sizing or mapping shared memory can fail with, and the fix each error
names: every ``ShmCapacityError`` of ``_slab`` keeps the kernel's errno and says how to
remedy that cause (docs/design.md, "Slab")."""

from __future__ import annotations

import errno

# errno -> how to fix it, for every way creating, sizing or mapping shared memory fails.
SPACE_FIX = ("give the container more shared memory (docker run --shm-size=...), pass fewer "
             "`slots`, or use smaller batches")
FIXES = {
    errno.ENOSPC: SPACE_FIX,
    errno.EFBIG: "raise the file-size limit (`ulimit -f`, RLIMIT_FSIZE), pass fewer `slots`, "
                 "or use smaller batches",
    errno.ENOMEM: "raise the address-space limit (`ulimit -v`, RLIMIT_AS) or free memory, pass "
                  "fewer `slots`, or use smaller batches",
    errno.EMFILE: "raise the open-file limit (`ulimit -n`, RLIMIT_NOFILE); every batch you "
                  "hold beyond the slab's `slots` keeps a descriptor of its own, so keep copies "
                  "of the batches you store (x.clone(), np.array(x)) or pass a larger `slots` "
                  "(ArenaLoader's equivalent of torch's advice to call torch.multiprocessing."
                  "set_sharing_strategy('file_system'), which has no effect on it); or use "
                  "fewer loaders or a smaller num_workers",
    errno.ENFILE: "the whole system is out of file descriptors (fs.file-max): close other "
                  "programs' files or raise fs.file-max",
    errno.EPERM: "make /dev/shm a writable tmpfs this user may create files in and map "
                 "(check the container's seccomp profile and mount options)",
}
FIXES[errno.EACCES] = FIXES[errno.EPERM]


# What a one-off segment's ENOSPC fix says instead of `slots` (segments hold single batches).
SEGMENT_SPACE_FIX = ("give the container more shared memory (docker run --shm-size=...), use "
                     "smaller batches, or hold fewer batches (keep copies: np.array(x) / "
                     "x.clone())")


def errno_of(exc: OSError) -> int:
    """posix_ipc raises OSError without an errno for some failures; its text tells which."""
    if exc.errno is not None:
        return exc.errno
    text = str(exc).lower()
    if "maximum number of files" in text:
        return errno.EMFILE
    if "system limit" in text:
        return errno.ENFILE
    if "permission" in text:
        return errno.EACCES
    if "memory" in text:
        return errno.ENOMEM
    return errno.ENOSPC
