"""Deprecated path: the binary simulator lives in ``sara.envs.sim.binary`` (also exported by ``sara.envs``)."""

from sara.deprecation import moved

__getattr__ = moved(__name__, "sara.envs.sim.binary")
