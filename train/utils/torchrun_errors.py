"""A rank's one-line error, handed to the torchrun agent: torchrun reads each failed rank's error
file (TORCHELASTIC_ERROR_FILE, set per rank) into its failure report, so the report names our
`error: ...` line instead of "To enable traceback see ...", and `python -m train.launch` prints
that line last. The file's layout is torchelastic's (errors/error_handler.py)."""
from __future__ import annotations

import json
import os
import time
from typing import Any

PREFIX = "error: "


def record_for_torchrun(line: str) -> None:
    """Write `line` (an `error: ...` line) as this rank's error file; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line was printed already; the report only loses its copy


def recorded_line(message: Any) -> str | None:
    """The `error: ...` line in a failure's parsed error-file message, else None."""
    text = message.get("message") if isinstance(message, dict) else message
    return text if isinstance(text, str) and text.startswith(PREFIX) else None
