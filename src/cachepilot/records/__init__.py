"""Decision records: every routing decision logged with its outcome, to explain and replay.

The gateway and the simulator write through :class:`Recorder` (or :class:`NullRecorder`
when no log is configured); ``cachepilot explain``, ``replay`` and ``decisions stats`` read
with :func:`open_log`.
"""

from cachepilot.records.recorder import NullRecorder, Recorder, open_recorder
from cachepilot.records.schema import SCHEMA_VERSION, decision_to_record
from cachepilot.records.store import LogNotFoundError, Store, open_log

__all__ = [
    "SCHEMA_VERSION",
    "LogNotFoundError",
    "NullRecorder",
    "Recorder",
    "Store",
    "decision_to_record",
    "open_log",
    "open_recorder",
]
