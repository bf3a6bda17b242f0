"""A fixed-seed fleet simulation gives the same answer in every process.

Python salts ``hash()`` of strings per process (``PYTHONHASHSEED``). The routers' views used to learn
their replicas by iterating a ``set`` of names, so the order in which a router ranked (score ties) and
cycled through (round-robin) replicas changed from one ``kvledger simulate --replicas N`` to the next:
the same command, seed and trace gave other per-replica loads, overcommits and latencies on each run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvledger.sim.fleet import FleetConfig, FleetSimulator
from kvledger.sim.simulator import SimConfig
from kvledger.workloads import Uniform, synthetic

SCRIPT = """
import json
from kvledger.sim.fleet import FleetConfig, FleetSimulator
from kvledger.sim.simulator import SimConfig
from kvledger.workloads import Gamma, Uniform, synthetic
reqs = synthetic(24, arrivals=Gamma(2000.0, 2.0), prompt_len=Uniform(8, 80), output_len=Uniform(1, 30), seed=1)
sim = SimConfig(model="smollm2-135m", gpu="h100-80gb", block_size=16, pool_blocks=24)
out = {}
for routing in ("round-robin", "score"):
    config = FleetConfig(sim=sim, replicas=4, routers=2, staleness_s=0.02, arm="A", routing=routing)
    r = FleetSimulator(config).run(reqs)
    out[routing] = [[p["replica"], p["requests"], p["prefill_tokens"], p["overcommits"]] for p in r.per_replica]
print(json.dumps(out))
"""


def _run(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), src) if p)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    return json.loads(done.stdout)


def test_the_fleet_simulation_does_not_depend_on_the_hash_seed() -> None:
    answers = [_run(seed) for seed in ("1", "2", "3")]
    assert answers[0] == answers[1] == answers[2]


def test_every_router_knows_the_replicas_in_their_order() -> None:
    """The views list r0, r1, ... in that order (what ranking ties and round-robin follow)."""
    reqs = synthetic(2, arrivals=[0.0, 0.0], prompt_len=Uniform(8, 9), output_len=1, seed=0)
    config = FleetConfig(sim=SimConfig(model="smollm2-135m", gpu="h100-80gb", pool_blocks=16), replicas=7,
                         routers=3, arm="A", staleness_s=0.0)
    sim = FleetSimulator(config)
    sim.run(reqs)
    names = [f"r{i}" for i in range(7)]
    assert [list(router.view.replicas) for router in sim.routers] == [names] * 3
    assert [router.view.candidates("default") for router in sim.routers] == [names] * 3
