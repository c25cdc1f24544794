"""Deprecated: the generation backends moved to ``sara.backends`` (the registry ``BACKENDS``, ``make_backend``).

``from sara.envs.backends import BACKENDS, make_backend`` still works, with a ``DeprecationWarning``; nothing is
imported until a name is asked for (no import of ``sara.backends`` from ``sara.envs``). Submodules moved:
``sara.envs.backends.{tiny,hf,vllm}`` -> ``sara.backends.{tiny,hf,vllm}``, ``sara.envs.backends._common`` ->
``sara.backends.text`` (with ``generator_state`` / ``NON_MODEL_PREFIXES`` in ``sara.hub``),
``sara.envs.backends.ray_pool`` -> ``sara.backends.ray`` (``LatencyEnv`` -> ``sara.envs.sim.latency``).
"""

from sara.deprecation import moved

__getattr__ = moved(__name__, {"BACKENDS": "sara.backends", "make_backend": "sara.backends"})
