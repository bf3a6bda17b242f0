"""Workloads: requests with arrival times, prompts and output lengths, below the simulator and the server.

Everything that replays or generates requests reads them here: the simulator and the fleet simulator,
``kvledger serve-trace`` and ``diagnose`` (the runtime's replays), and the load client ``kvledger bench
serve``. The standard library and ``kvledger.core`` only.

- :mod:`.requests`: ``SimRequest`` and its compact ``Prompt`` (runs of consecutive synthetic token ids; a
  read-only ``Sequence[int]``, ``.tolist()`` materialises it). Token ids identify prefixes; they are not ids
  in any model's vocabulary.
- :mod:`.readers`: the trace readers (Mooncake JSONL, Azure CSV, length tables, kvledger's own schema).
- :mod:`.formats`: the trace-format registry (``TRACE_FORMATS``), the one sniffer (``sniff_trace_format``,
  ``trace_format``, ``trace_has_arrivals``) and ``load_trace``.
- :mod:`.distributions`: seeded length distributions and arrival processes.
- :mod:`.generator`: the seeded synthetic generator (shared system prompts, trust groups, n > 1).
- :mod:`.transforms`: replay faster or at a rate, scale lengths, slice a window, split into tenants.

Every reader and generator returns a list sorted by arrival time (stable, so file order breaks ties).
"""

from __future__ import annotations

# Each module names its public API in its own ``__all__``; the package offers all of them.
from . import distributions, formats, generator, readers, requests, transforms
from .distributions import *  # noqa: F403
from .formats import *  # noqa: F403
from .generator import *  # noqa: F403
from .readers import *  # noqa: F403
from .requests import *  # noqa: F403
from .transforms import *  # noqa: F403

__all__ = [*requests.__all__, *distributions.__all__, *readers.__all__, *formats.__all__, *generator.__all__,
           *transforms.__all__]
