"""A fleet of ledgers: several engine replicas behind routers that only advise.

The principle: a router ranks replicas and sends a request to the best one; memory is committed only by
that replica's own ledger, atomically, and a refusal ("not now") is a cheap, normal answer that sends the
request elsewhere. Two halves:

* the **policy** -- :mod:`.score` (the one cost function), :mod:`.view` (a router's stale view of the
  replicas and its prefix index) and :mod:`.door` (a replica's admission door and its commitment book).
  Standard library and ``kvledger.core`` only, no Ray and no torch: the fleet simulator
  (:mod:`kvledger.sim.fleet`) and the live fleet import exactly this code;
* the **Ray faces** -- :mod:`.serve` (Ray Serve deployments: engine replicas and the OpenAI-compatible
  ingress) and :mod:`.router` (Ray Serve's ``RequestRouter`` over the same view). They import Ray, which
  the ``fleet`` extra installs (``pip install 'kvledger[fleet]'``).

Nothing here is imported by ``import kvledger.fleet``: import the module you need.
"""

from __future__ import annotations
