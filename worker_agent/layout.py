"""A job's own directories: its output and the dataloader's caches go under its job directory, whatever its config says.

Two jobs on one node must never share an output directory or a cache: SimpleTuner reuses the VAE latents
and text embeddings it finds in a cache directory, so a cache left by another job (another model, other
data, other settings) changes the weights a run produces. The agent therefore writes every such path of
the trainer's config (SimpleTuner's keys, at the top level and in each ``multidatabackend.json`` entry)
as a directory of the job's own.
"""

import re
from pathlib import Path

OUTPUT_DIR = "output"
CACHE_DIR = "cache"
# Top-level config keys naming a cache directory -> where it goes under <job dir>/cache.
CONFIG_CACHE_KEYS = {"cache_dir": "", "cache_dir_text": "text", "cache_dir_vae": "vae"}
# Keys of a dataloader entry naming a cache of that dataset -> the folder of <job dir>/cache it goes in.
# ``cache_dir`` (text or image embeddings, a memory backend's source, Webshart's metadata) goes in the
# folder named by the entry's ``dataset_type`` (else its ``type``).
ENTRY_CACHE_KEYS = {
    "cache_dir_vae": "vae",
    "cache_dir_conditioning_image_embeds": "conditioning_image_embeds",
    "csv_cache_dir": "csv",
}
NESTED_CACHE_KEYS = {"audio": "audio", "webshart": "webshart"}  # entry[block]["cache_dir"]
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def config_key(config, name):
    """Return the config key ``name``, in the config's own style (``--x`` or ``x``)."""
    if name in config or f"--{name}" in config:
        return name if name in config else f"--{name}"
    dashed = any(str(key).startswith("--") for key in config)
    return f"--{name}" if dashed else name


def _present(config, name):
    """Return the key under which ``config`` holds a value for ``name`` (``x`` or ``--x``), or None."""
    for key in (name, f"--{name}"):
        if config.get(key) not in (None, ""):
            return key
    return None


def own_config(config, job_dir):
    """Return a copy of ``config`` whose output directory is ``<job dir>/output`` and whose cache
    directories (``cache_dir``, ``cache_dir_text``, ``cache_dir_vae``, where it names them) are under
    ``<job dir>/cache``."""
    job_dir = Path(job_dir)
    config = dict(config)
    config[config_key(config, "output_dir")] = str(job_dir / OUTPUT_DIR)
    for name, folder in CONFIG_CACHE_KEYS.items():
        key = _present(config, name)
        if key is not None:
            config[key] = str(job_dir / CACHE_DIR / folder) if folder else str(job_dir / CACHE_DIR)
    return config


def _entry_names(entries):
    """Return a distinct folder name for each entry: its ``id`` made path-safe, else its position."""
    names, used = [], set()
    for index, entry in enumerate(entries):
        raw = entry.get("id") if isinstance(entry, dict) else None
        name = _UNSAFE.sub("_", str(raw)).strip("._") if raw not in (None, "") else ""
        name = name or f"dataset-{index}"
        candidate, n = name, 1
        while candidate in used:
            n += 1
            candidate = f"{name}-{n}"
        used.add(candidate)
        names.append(candidate)
    return names


def own_dataloader(dataloader, job_dir):
    """Return a copy of ``dataloader`` (a list of SimpleTuner dataset entries, or one entry) whose cache
    directories are under ``<job dir>/cache/<kind>/<entry id>``; anything else is returned as it is."""
    single = isinstance(dataloader, dict)
    entries = [dataloader] if single else dataloader
    if not isinstance(entries, list):
        return dataloader
    cache = Path(job_dir) / CACHE_DIR
    owned = []
    for entry, name in zip(entries, _entry_names(entries)):
        if not isinstance(entry, dict):
            owned.append(entry)
            continue
        entry = dict(entry)
        if entry.get("cache_dir") not in (None, ""):
            kind = _UNSAFE.sub("_", str(entry.get("dataset_type") or entry.get("type") or "data")).strip("._") or "data"
            entry["cache_dir"] = str(cache / kind / name)
        for key, folder in ENTRY_CACHE_KEYS.items():
            if entry.get(key) not in (None, ""):
                entry[key] = str(cache / folder / name)
        for block, folder in NESTED_CACHE_KEYS.items():
            if isinstance(entry.get(block), dict) and entry[block].get("cache_dir") not in (None, ""):
                entry[block] = {**entry[block], "cache_dir": str(cache / folder / name)}
        owned.append(entry)
    return owned[0] if single else owned
