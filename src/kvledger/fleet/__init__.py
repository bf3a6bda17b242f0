"""The fleet on Ray: several engine replicas behind routers that only advise.

The fleet's policy -- the routing score, a router's view, a replica's admission door -- is the Ray-free
:mod:`kvledger.placement` package, which the fleet simulator (:mod:`kvledger.sim.fleet`) uses too. This
package holds only the **Ray faces**: :mod:`.serve` (Ray Serve deployments: engine replicas and the
OpenAI-compatible ingress), :mod:`.router` (Ray Serve's ``RequestRouter`` over the placement view) and
:mod:`.spec` (``FleetSpec``, the deployment's settings, read by ``kvledger fleet serve``). Ray comes with the
``fleet`` extra (``pip install 'kvledger[fleet]'``).

Nothing here is imported by ``import kvledger.fleet``: import the module you need. Importing the package
does one thing: it sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment, because Ray reads it
when *it* is imported -- without it Ray takes the machine's private address and listens on every
interface -- and the fleet's Ray faces import Ray. Import ``kvledger.fleet`` (or any of its modules)
before Ray; :func:`kvledger.fleet.serve.local_ray` refuses to run a Ray that listens beyond 127.0.0.1.
A simulation never imports this package, so it never touches Ray's environment.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
