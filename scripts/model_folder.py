"""A prepared folder of the model cache (``make model``): written whole into a temporary sibling, with a
marker file that records what was written, then renamed into place. A folder is there complete and says
what it holds, or is not there at all: a run that dies half-way leaves the folder as it was and no
temporary beside it, and a second run with the same marker is a no-op.

Used by ``prepare_model.py`` (the default model) and ``prepare_adapters.py`` (the test adapters and the
merged model); standard library only, so that the no-op path stays fast.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER_FILE_NAME = ".tandem-prepared.json"


def has_marker(folder: Path, marker: dict[str, Any]) -> bool:
    """Whether ``folder`` holds exactly what ``marker`` describes (False when it or its marker is missing)."""
    try:
        return bool(json.loads((folder / MARKER_FILE_NAME).read_text()) == marker)
    except (OSError, ValueError):
        return False


def publish(
    folder: Path, marker: dict[str, Any], write: Callable[[Path], None], *, file_mode: int | None = None
) -> None:
    """Run ``write(tmp)`` on a temporary sibling of ``folder``, set the mode of the files it wrote to
    ``file_mode`` (None: as written), add the marker, and rename it into place of ``folder``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(tmp_dir)
        if file_mode is not None:
            for written in tmp_dir.iterdir():
                written.chmod(file_mode)
        (tmp_dir / MARKER_FILE_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp_dir.chmod(0o755)  # mkdtemp makes it private; models and adapters are not secrets
        tmp_dir.rename(folder)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
