"""Connecting to Ray: ``init_ray`` joins a cluster or starts a local one (no dashboard, no auth token file)."""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["init_ray"]


def init_ray(address: str | None = None, *, num_cpus: int | None = None, temp_dir: str | None = None,
             log_to_driver: bool = False, **kwargs: Any) -> bool:
    """Connect to Ray (or start a local cluster) unless it is already initialized.

    A local cluster is started without dashboard and, unless ``RAY_AUTH_MODE`` is already set, with token
    authentication off (Ray would otherwise write ``~/.ray/auth_token``).

    Args:
        address: Existing cluster (``"auto"``, ``"ray://host:10001"``); None = local.
        num_cpus: Logical CPUs of a local cluster (default: the machine's).
        temp_dir: Ray's session directory for a local cluster (default ``/tmp/ray``). Keep the path short: it holds
            unix sockets.
        log_to_driver: Forward worker output to this process.
        **kwargs: More ``ray.init`` options.

    Returns:
        True when this call started / connected Ray (so the caller should ``ray.shutdown()`` it), False when Ray was
        already initialized.
    """
    import ray

    if ray.is_initialized():
        return False
    opts: dict[str, Any] = dict(include_dashboard=False, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if num_cpus is not None:
            opts["num_cpus"] = num_cpus
        if temp_dir is not None:
            opts["_temp_dir"] = temp_dir
    else:
        opts["address"] = address
    opts.update(kwargs)
    ray.init(**opts)
    return True
