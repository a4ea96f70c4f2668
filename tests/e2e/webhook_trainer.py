"""A stand-in for SimpleTuner's trainer in end-to-end tests: it reports only through the webhooks in its config.

Like ``python -m simpletuner.train`` it reads the JSON config named by ``CONFIG_PATH``, prints no progress
lines, and posts its events as JSON to every ``raw`` entry of ``webhook_config`` (a list, or one entry) with
the entry's ``auth_token`` as ``X-API-Key``, waiting for each answer (``helpers/webhooks/handler.py``). The
events are the ones SimpleTuner's trainer really posted (``tests/agent/simpletuner_events.json``).

Config: ``fake_events`` (``run``: a 6-step LoRA run, exit 0; ``failure``: a crash loading the model, exit 1
after a coloured traceback whose last line is a bare colour reset), ``fake_step_delay`` (seconds to wait
after each training step's event, 0.4), ``fake_silent`` (post nothing: as a trainer without webhooks).
"""

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

EVENTS = Path(__file__).resolve().parent.parent / "agent" / "simpletuner_events.json"

CRASH = (
    "\x1b[0mTraceback (most recent call last):\n"
    '\x1b[0m\x1b[0m  File "/venv/src/simpletuner/train.py", line 281, in <module>\n'
    "\x1b[0m\x1b[0m    \x1b[0mtrainer = Trainer(\x1b[0m\n"
    "\x1b[0m\x1b[0mOSError\x1b[0m: \x1b[0mWe couldn't connect to 'https://huggingface.co' to load this model\x1b[0m\n"
    "\x1b[0m\n"
)


def hooks_of(config):
    hooks = config.get("webhook_config", config.get("--webhook_config"))
    hooks = [hooks] if isinstance(hooks, dict) else hooks or []
    return [hook for hook in hooks if isinstance(hook, dict) and hook.get("webhook_type") == "raw"]


def post(hook, event):
    request = urllib.request.Request(
        hook["callback_url"],
        data=json.dumps(event).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-API-Key": hook.get("auth_token") or ""},
    )
    urllib.request.urlopen(request, timeout=5).read()


def main():
    config = json.loads(Path(os.environ["CONFIG_PATH"]).read_text())
    sequence = config.get("fake_events", "run")
    delay = float(config.get("fake_step_delay", 0.4))
    hooks = [] if config.get("fake_silent") else hooks_of(config)
    print(f"\x1b[32mINFO\x1b[0m fake trainer: {sequence}, {len(hooks)} raw webhook(s)", flush=True)
    for event in json.loads(EVENTS.read_text())[sequence]:
        for hook in hooks:
            post(hook, event)
        if event.get("type") == "training.status":
            time.sleep(delay)
    if sequence == "failure":
        sys.stdout.write(CRASH)
        sys.stdout.flush()
        return 1
    print("\x1b[1mtraining complete\x1b[0m")
    return 0


if __name__ == "__main__":
    sys.exit(main())
