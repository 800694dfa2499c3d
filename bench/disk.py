"""What a new folder with a small file costs on the disk a benchmark writes to.

A dumped round begins with such a folder and file, and on one machine their price varies
several times with the file system's state (docs/performance.md, "Files on this disk"), so
every benchmark report gives it beside its results: two reports are comparable only where it
is close. Standard library only (bench/run.py and bench/vllm_offline.py run it in any
environment).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time


def disk_file_us(root: str, folders: int = 16) -> int | None:
    """Median microseconds to make a folder and write a 5 KB file in it under `root`: what a
    dumped round's first file costs the writer on that disk. One disk can give several times
    more on some days than on others (the 2-vCPU VM's: ~700 us in a /tmp that 27 GB of earlier
    runs had filled, 80-100 us once they were removed), and every statistics case writes two
    such files a round, so the number is kept beside the results."""
    data = b"x" * 5000
    times = []
    try:
        probe = tempfile.mkdtemp(prefix="disk-", dir=root)
    except OSError:
        return None
    try:
        for i in range(folders):
            start = time.perf_counter()
            folder = os.path.join(probe, str(i))
            os.mkdir(folder)
            with open(os.path.join(folder, "file"), "wb") as f:
                f.write(data)
            times.append(time.perf_counter() - start)
    except OSError:
        return None
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return round(sorted(times)[len(times) // 2] * 1e6)


def disk_note(us: int | None) -> str:
    if us is None:
        return "the work folder's file cost was not measured"
    return f"a new folder with a 5 KB file took {us} µs in the work folder"
