"""What the CPU benchmarks share: a run made once and read after, while nothing it depends on has changed."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def key_of(command, data_folders):
    """What a finished run depends on: its command, every script and shared module, its data's files, the versions."""
    files = sorted(REPO.glob("*.py")) + [path for folder in data_folders for path in sorted((REPO / folder).rglob("*"))
                                         if path.is_file()]
    return {"command": [str(part) for part in command],
            "files": {str(path.relative_to(REPO) if path.is_relative_to(REPO) else path):
                      hashlib.sha256(path.read_bytes()).hexdigest() for path in files},
            "versions": {name: version(name) for name in ("torch", "transformers", "tiktoken", "numpy")}}


def run_once(folder, command, data_folders):
    """Runs command unless folder holds a finished run of the same key; a failure shows its stderr's end and stops."""
    folder, key = Path(folder), key_of(command, data_folders)
    if (folder / "run-key.json").is_file() and json.loads((folder / "run-key.json").read_text()) == key:
        return
    shutil.rmtree(folder, ignore_errors=True)
    done = subprocess.run([str(part) for part in command], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(map(str, command))}\n{done.stderr[-3000:]}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run-key.json").write_text(json.dumps(key))


def finite(loss):
    """A loss to rank by: NaN counts as infinite, so that min() never picks a run that diverged."""
    return math.inf if math.isnan(loss) else loss
