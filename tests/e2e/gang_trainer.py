"""A trainer that proves a multi-node job's rendezvous (standard library; torch when asked and importable).

Reads the JSON config at ``CONFIG_PATH``: ``barrier_dir`` (a directory shared by the test) and ``name``. Rank 0
(``NODE_RANK``) listens on ``MASTER_ADDR:MASTER_PORT`` and accepts ``NNODES - 1`` connections; every other rank
connects to it (retrying until ``wait_s``, default 30). Each side sends its rank and reads the other's, so rank 0
hears every other rank and each other rank hears 0. While the file ``<barrier_dir>/hold`` exists the members then
wait (a test kills one meanwhile). With ``torch: true`` in the config and torch importable, the members also run a
``torch.distributed`` gloo all-reduce of their ranks over the same rendezvous (on MASTER_PORT + 1). Each member
writes ``<barrier_dir>/<name>-rank<rank>-<pid>.json``: what it was given (its ``CUDA_VISIBLE_DEVICES`` too) and what it heard; exit 0 when it heard
every rank it should, 3 when not. A one-node job (no ``NNODES``) meets no one: it only records and waits.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path


def _exchange(sock, rank):
    sock.sendall(f"{rank}\n".encode())
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            break
        data += chunk
    return int(data.decode().strip())


def rendezvous(addr, port, rank, nodes, deadline):
    """Return the ranks heard: every other rank at rank 0, rank 0 elsewhere."""
    if rank == 0:
        server = socket.create_server((addr, port))
        server.settimeout(max(deadline - time.monotonic(), 0.1))
        heard = []
        with server:
            for _ in range(nodes - 1):
                conn, _ = server.accept()
                with conn:
                    heard.append(_exchange(conn, rank))
        return sorted(heard)
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2) as conn:
                return [_exchange(conn, rank)]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def all_reduce(addr, port, rank, nodes):
    """A gloo all-reduce of the ranks across the members; return its result, or a reason it did not run."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch not importable: {exc}"
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port + 1}", rank=rank, world_size=nodes)
    try:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        return value.item()
    finally:
        dist.destroy_process_group()


def main():
    config = json.loads(Path(os.environ["CONFIG_PATH"]).read_text())
    barrier = Path(config["barrier_dir"])
    addr, port = os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT") or 0)
    rank, nodes = int(os.environ.get("NODE_RANK") or 0), int(os.environ.get("NNODES") or 1)
    deadline = time.monotonic() + float(config.get("wait_s", 30))
    heard = rendezvous(addr, port, rank, nodes, deadline) if nodes > 1 else []  # a one-node job: nothing to meet
    while (barrier / "hold").exists():
        time.sleep(0.1)
    seen = {
        "rank": rank,
        "nodes": nodes,
        "master_addr": addr,
        "master_port": port,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "heard": heard,
        "machine_rank": config.get("machine_rank"),
        "num_machines": config.get("num_machines"),
        "main_process_ip": config.get("main_process_ip"),
        "main_process_port": config.get("main_process_port"),
        "same_network": config.get("same_network"),
        "all_reduce": all_reduce(addr, port, rank, nodes) if config.get("torch") and nodes > 1 else None,
        "pid": os.getpid(),
    }
    partial = barrier / f".{config['name']}-rank{rank}-{os.getpid()}.json.part"
    partial.write_text(json.dumps(seen))
    partial.rename(barrier / f"{config['name']}-rank{rank}-{os.getpid()}.json")
    print(f"rendezvous {seen}", flush=True)
    expected = list(range(1, nodes)) if rank == 0 else [0]
    return 0 if heard == expected else 3


if __name__ == "__main__":
    sys.exit(main())
