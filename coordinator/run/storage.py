"""What the coordinator says when its disk fills up: a stop with a reason, not a traceback."""

from __future__ import annotations

import errno
from pathlib import Path

# ENOSPC: the file system is full; EDQUOT: the user's quota is; EFBIG: a file-size limit (RLIMIT_FSIZE).
OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def out_of_space_message(exc: OSError, run_dir: Path) -> str:
    """The stop message for a write that found no space; other OS errors are re-raised unchanged.

    Every write to the run directory is atomic and uploads are acknowledged only once journaled, so
    nothing committed is lost: the open round resumes with the uploads journaled so far and devices
    resend the ones they were never acknowledged.
    """
    if exc.errno not in OUT_OF_SPACE:
        raise exc
    where = f" ({exc.filename})" if exc.filename else ""
    return (
        f"no space left to write the run directory{where}: {exc.strerror}. The coordinator stopped; "
        f"nothing committed is lost. Free space (or prune old runs), then run the same command to resume {run_dir}"
    )
