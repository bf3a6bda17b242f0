"""Placement: where a request goes in a fleet of ledgers, without Ray.

Routers only advise; memory is committed only by the chosen replica's own ledger, atomically, and a
refusal ("not now") is a cheap, normal answer that sends the request elsewhere. This package is that
policy, beside the scheduler:

* :mod:`.score` -- the one cost function, in blocks, that ranks replicas;
* :mod:`.view` -- a router's stale view of the replicas and its prefix index;
* :mod:`.door` -- a replica's admission door and its commitment book.

The standard library and ``kvledger.core`` only, no Ray and no torch, and importing it touches no
environment variable: the fleet simulator (:mod:`kvledger.sim.fleet`) and the live Ray fleet
(:mod:`kvledger.fleet`, the Ray faces) rank replicas and decide admissions with this very code. Nothing is
imported by ``import kvledger.placement``: import the module you need.
"""
