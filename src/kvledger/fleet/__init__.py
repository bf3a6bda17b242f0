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

Nothing here is imported by ``import kvledger.fleet``: import the module you need. Importing the package
does one thing: it sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment, because Ray reads it
when *it* is imported -- without it Ray takes the machine's private address and listens on every
interface -- and the fleet's Ray faces import Ray. Import ``kvledger.fleet`` (or any of its modules)
before Ray; :func:`kvledger.fleet.serve.local_ray` refuses to run a Ray that listens beyond 127.0.0.1.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
