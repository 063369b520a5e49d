"""etcd discovery: the worker's key under a lease that a background task keeps alive, and
the router's watch of those keys (``pip install 'quiesce[etcd]'``: ``aetcd`` 1.0.0,
imported lazily).

- :class:`EtcdDiscovery` (:mod:`.discovery`): the worker's side: the key layout,
  register, keep-alive and unregister, what each costs and what happens on failure;
- :class:`EtcdWatcher` (:mod:`.watcher`): the router's side, a watch of the prefix;
- :class:`EtcdConfig` (:mod:`.config`): where and how to register;
- :mod:`.client`: the lazy ``aetcd`` import, the gRPC channel's options, which failures
  are retried;
- :mod:`.local`: a throw-away etcd on loopback, for tests, benchmarks and demos.
"""

from quiesce.discovery import DiscoveryUnavailable

from .config import EtcdConfig
from .discovery import EtcdDiscovery
from .watcher import EtcdWatcher

__all__ = ["DiscoveryUnavailable", "EtcdConfig", "EtcdDiscovery", "EtcdWatcher"]
