"""A trainer that checkpoints as SimpleTuner's does and uploads nothing itself (standard library only).

Reads the JSON config at ``CONFIG_PATH``: ``max_train_steps``, ``checkpoint_every``, ``step_delay`` (seconds),
``output_dir`` (set by the agent), ``resume_from_checkpoint`` (a checkpoint's directory name) and, for a test's
window to kill its node, ``pause_after``: ``[step, seconds]`` to sleep once that step's checkpoint is marked.
Its "weights" after step N are a hash chain over the steps, so a resumed run ends with the bytes of an
uninterrupted one. Every ``checkpoint_every`` steps it writes ``checkpoint-<step>/`` (``model.safetensors``,
``state.json`` with a run-varying time) and then its ``.guard`` saying ``complete``, last; at the end
``model.safetensors`` in the output directory.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

WEIGHTS = "model.safetensors"


def weights_after(step, seed=0):
    """The weights an uninterrupted run has after ``step`` steps."""
    weights = hashlib.sha256(str(seed).encode()).digest()
    for n in range(1, step + 1):
        weights = advance(weights, n)
    return weights * 64


def advance(weights, step):
    return hashlib.sha256(weights[:32] + step.to_bytes(8, "big")).digest()


def main():
    config = json.loads(Path(os.environ["CONFIG_PATH"]).read_text())
    total, every = int(config["max_train_steps"]), int(config["checkpoint_every"])
    out = Path(config["output_dir"])
    pause_step, pause_seconds = config.get("pause_after") or (None, 0)
    step, weights = 0, hashlib.sha256(str(config.get("seed", 0)).encode()).digest()
    resume = config.get("resume_from_checkpoint")
    if resume and resume != "latest":
        state = json.loads((out / resume / "state.json").read_text())
        step, weights = state["step"], bytes.fromhex(state["weights"])
        print(f"resumed from {resume} at step {step}", flush=True)
    while step < total:
        time.sleep(float(config.get("step_delay", 0)))
        step += 1
        weights = advance(weights, step)
        print(f"step {step}/{total}", flush=True)
        if step % every == 0:
            directory = out / f"checkpoint-{step}"
            directory.mkdir(parents=True, exist_ok=True)
            (directory / WEIGHTS).write_bytes(weights * 64)
            (directory / "state.json").write_text(json.dumps({"step": step, "weights": weights.hex(), "at": time.time()}))
            (directory / ".guard").write_text("complete\n")
            if step == pause_step:
                time.sleep(float(pause_seconds))
    (out / WEIGHTS).write_bytes(weights * 64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
