"""A trainer that records the GPUs it was given and waits for the jobs meant to run beside it (standard library only).

Reads the JSON config at ``CONFIG_PATH``: ``barrier_dir`` (a directory shared by the jobs of one test),
``peers`` (how many jobs, itself included, must be running at once) and ``name``. It writes
``<barrier_dir>/<name>.json`` with its ``CUDA_VISIBLE_DEVICES`` and the config's ``accelerate_visible_devices``
and ``num_processes``, then waits up to ``wait_s`` seconds (default 30) for ``peers`` such files: exit 0 when
they are all there (the jobs ran side by side), 3 when not. Without ``peers`` it only records and exits 0.
"""

import json
import os
import sys
import time
from pathlib import Path


def main():
    config = json.loads(Path(os.environ["CONFIG_PATH"]).read_text())
    barrier = Path(config["barrier_dir"])
    seen = {
        "name": config["name"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "accelerate_visible_devices": config.get("accelerate_visible_devices"),
        "num_processes": config.get("num_processes"),
        "pid": os.getpid(),
    }
    partial = barrier / f".{config['name']}.json.part"
    partial.write_text(json.dumps(seen))
    partial.rename(barrier / f"{config['name']}.json")
    print(f"recorded {seen}", flush=True)
    peers = int(config.get("peers") or 0)
    deadline = time.monotonic() + float(config.get("wait_s", 30))
    while peers and len(list(barrier.glob("*.json"))) < peers:
        if time.monotonic() > deadline:
            print(f"only {len(list(barrier.glob('*.json')))} of {peers} jobs ran at once", flush=True)
            return 3
        time.sleep(0.05)
    hold = float(config.get("hold_s", 0))
    if hold:
        time.sleep(hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
