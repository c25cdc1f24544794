"""Deprecated: training checkpoints moved to ``sara.train.checkpoint``, the file lock to ``sara.storage``.

``from sara.checkpoint import latest_checkpoint`` still works, with a ``DeprecationWarning``; nothing is imported
until a name is asked for.
"""

from sara.deprecation import moved

_CKPT = "sara.train.checkpoint"
_MOVED = ("save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "rng_state", "set_rng_state",
          "prune_checkpoints")
__getattr__ = moved(__name__, {**{name: _CKPT for name in _MOVED}, "file_lock": "sara.storage"})
