"""Deprecated: model preparation moved to ``sara.hub`` (``prepare_model``, ``resolve_model``, ``MODELS``, ...).

Every public name of ``sara.hub`` is still importable from here, with a ``DeprecationWarning``; nothing is imported
until a name is asked for.
"""

from sara.deprecation import moved

__getattr__ = moved(__name__, "sara.hub")
